"""Who shares cached prompt prefixes with whom: the engine's `cache_salt`, derived per request.

The salt is the server's decision, never the client's alone: with `tenant_header` configured it
hashes the tenant named by that header (set by a trusted gateway) with the optional `cache_salt`
body field, so no body can name another tenant's salt; without it the deployment is one tenant
and `cache_salt` alone separates (docs/serving.md, "Tenants and prompt caching: threat model").
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

from orcaserve.handler.openai.protocol import ParsedRequest, ProtocolError
from orcaserve.scheduler.engine_request import EngineRequest


class TenancySettings(Protocol):
    """The serving settings tenancy reads (`HandlerConfig`'s, docs/serving.md)."""

    tenant_header: str | None
    slo_class_header: str | None
    tenant_slo_class: dict[str, str]


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def header_value(headers: Mapping[Any, Any], name: str) -> str | None:
    """The value of request header `name`, matched case-insensitively, or None.

    TorchServe hands the handler the header names as the client wrote them, in one dict with the
    request's parameters: a query parameter `?X-Tenant-Id=...` appears there under that name with
    a dict value. Only string values are headers. Two spellings of the name with different values
    are refused: which one the gateway set cannot be told.
    """
    wanted = name.lower()
    values = {v for k, v in headers.items() if isinstance(k, str) and k.lower() == wanted and isinstance(v, str)}
    if len(values) > 1:
        raise ProtocolError(f"header {name} is given more than once with different values")
    return values.pop() if values else None


def derive_cache_salt(tenant_header: str | None, headers: Mapping[Any, Any], cache_salt: str | None) -> str | None:
    """The engine's cache salt for one request; raises ProtocolError (400) if the tenant is missing.

    With a tenant header configured, a request without it (or with an empty value) is refused
    rather than filed under a shared anonymous tenant: a gateway that stopped setting the header
    would otherwise pool every tenant's traffic into one cache namespace, the very leak this
    prevents, and do so silently. Lengths prefix every field, so distinct (tenant, salt) pairs
    never hash the same input; the tags keep the tenant and single-tenant namespaces apart.
    """
    salt = None if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass")
    if tenant_header is None:
        if salt is None:
            return None  # one tenant, no subdivision: every request may share
        return hashlib.sha256(b"orcaserve-salt\0" + _field(salt)).hexdigest()
    tenant = header_value(headers, tenant_header)
    if tenant is None or not tenant.strip():
        raise ProtocolError(f"this server requires the {tenant_header} header naming the tenant")
    h = hashlib.sha256(b"orcaserve-tenant\0" + _field(tenant.encode("utf-8", "surrogatepass")))
    h.update(b"\0" if salt is None else b"\1" + _field(salt))
    return h.hexdigest()


def with_tenancy(parsed: ParsedRequest, headers: Mapping[Any, Any], settings: TenancySettings) -> EngineRequest:
    """The parsed request as the engine serves it: with the cache salt derived for it (refusing a
    missing tenant), the tenant its share is counted for (fair policy, per-tenant metrics), and its
    latency class (the class header, else the tenant's class; an unknown class is the engine's 400)."""
    salt = derive_cache_salt(settings.tenant_header, headers, parsed.cache_salt)
    tenant = header_value(headers, settings.tenant_header) if settings.tenant_header else None
    slo_class = header_value(headers, settings.slo_class_header) if settings.slo_class_header else None
    if slo_class is None and tenant is not None:
        slo_class = settings.tenant_slo_class.get(tenant)
    return dataclasses.replace(parsed.request, cache_salt=salt, tenant=tenant, slo_class=slo_class)
