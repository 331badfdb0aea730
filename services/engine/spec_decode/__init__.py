"""Speculative decoding (vLLM's `--speculative-config`): several tokens per request per step.

    Scheduler.schedule()        a decode asks the Speculator for drafts (n-gram lookup in the
        │                       request's own tokens); 1 + k tokens scheduled, budget and KV
        │                       slots counted for all of them (ScheduledRequest.spec_token_ids)
    ModelRunner.execute()       one target forward over the k + 1 positions, in the same batch
        │                       as prefills and plain decodes; rejection.py keeps the accepted
        │                       drafts and samples the token after them
    Scheduler.update_from_output  appends the accepted run, rolls num_computed_tokens back over
        │                       the rejected drafts (their slots are overwritten later), records
        │                       the acceptance (stats, per-request back-off)
    OutputProcessor             checks every stop token by token through the run (truncates it)

    config: kvmesh.common.speculative_config (EngineConfig holds it)
    ngram.py       the prompt-lookup proposer
    speculator.py  who speculates this step, how many drafts; acceptance bookkeeping
    rejection.py   verification: target distribution kept exactly, greedy token-identical
    tokens.py      a request's tokens followed by its drafts, as the input batch reads them
    draft_model.py the draft-model proposer; grammar_drafts.py: its drafts under a grammar
"""
