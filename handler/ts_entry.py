"""The handler file put into model archives: TorchServe imports it by path.

It stays a thin subclass so archives never carry a stale copy of the implementation: the code
comes from the `orcaserve` package installed in the Python environment that runs TorchServe.
TorchServe picks the single class defined in this module.
"""

from orcaserve.handler.orca_handler import OrcaHandler as _OrcaHandler


class OrcaHandler(_OrcaHandler):
    """See orcaserve.handler.orca_handler.OrcaHandler."""
