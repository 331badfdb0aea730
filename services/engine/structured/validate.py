"""The input processor's check of a request's structured output (once, on the way in)."""
from __future__ import annotations

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured.spec import StructuredOutputError, StructuredOutputSpec


def check_structured(params: SamplingParams) -> None:
    """StructuredOutputError (a ValueError with `param`) if the spec cannot be served."""
    spec = params.structured_outputs
    if not isinstance(spec, StructuredOutputSpec):
        raise StructuredOutputError("structured_outputs must be a StructuredOutputSpec",
                                    param="structured_outputs")
    # NOTE: a completed grammar allows only the end-of-sequence tokens: without them (ignore_eos,
    # or masked by min_tokens) no token would be left to sample.
    if params.ignore_eos:
        raise StructuredOutputError("ignore_eos cannot be combined with structured outputs: the "
                                    "output ends with an end-of-sequence token when the grammar "
                                    "completes", param="ignore_eos")
    if params.min_tokens:
        raise StructuredOutputError("min_tokens cannot be combined with structured outputs: the "
                                    "grammar decides where the output ends", param="min_tokens")
    from kvmesh.engine.structured.grammar import parse
    parse(spec, "structured_outputs")
