"""kvmesh operator: reconciles `InferenceService` custom resources into engine, router, Redis and
ingress objects. Importable as `kvmesh.operator`; never imports torch or the engine."""

GROUP = "kvmesh.io"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"
