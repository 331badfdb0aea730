"""The offline engine: paged KV cache, scheduler, model runner."""
