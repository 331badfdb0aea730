"""Structured outputs: constrain sampling to a JSON schema, a regex, a choice or an EBNF grammar
with xgrammar.

    spec.py             StructuredOutputSpec: what a request asks for (kind + canonical text), no xgrammar
    schema_support.py   JSON-schema keywords xgrammar cannot enforce -> a clear error naming them
    grammar.py          spec -> xgrammar Grammar (the parse that validates a spec at the boundary)
    compiler.py         GrammarCompilerPool: compile once per spec, on its own threads, bounded LRU
    request_grammar.py  RequestGrammar: one matcher per sample, advanced with each accepted token
    bitmask.py          GrammarBitmask: the allowed tokens of the constrained rows of one step
    manager.py          StructuredOutputManager: the engine's one entry point

The path of a constrained request: the API (or `LLM`) builds a spec; the input processor checks
it (grammar.parse); `LLMEngine.add_request` gives every sample a RequestGrammar whose compile runs
on the pool while the request waits as WAITING_FOR_GRAMMAR (the scheduler skips it); each step
the manager fills a bitmask for the constrained rows, the runner applies it to their logits
before the sampler, and the manager advances each sample's matcher with its token. A grammar
that completes allows only the end-of-sequence tokens, so the request stops with "stop".
"""
