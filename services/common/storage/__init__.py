"""Model storage: where a model comes from (a local path, s3://, hf://, pvc://), the node-local
cache it is fetched into, and the fetch itself. See fetch.fetch."""
from kvmesh.common.storage.errors import FetchError
from kvmesh.common.storage.fetch import FetchedModel, FetchOptions, fetch, resolve_engine_model
from kvmesh.common.storage.uri import ModelSource, is_uri, parse_source

__all__ = ["FetchError", "FetchOptions", "FetchedModel", "ModelSource", "fetch", "is_uri",
           "parse_source", "resolve_engine_model"]
