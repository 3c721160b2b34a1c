"""Fair share between tenants over a real TorchServe (`orcaserve-bench fair`) and its report."""
