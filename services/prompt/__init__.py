"""Prompts without torch: where a tokenizer comes from, chat-message normalisation and
chat-template rendering. The API server, the engine and the router all render through here, so
the router's token ids (and so its block hashes) are the engines' by construction.

    sources.py   model path / tokenizer dir / built-in name -> Tokenizer (GGUF: converted once, cached)
    messages.py  OpenAI chat messages -> the dicts chat templates expect
    tokenizer.py Tokenizer: encode / decode / render_chat (tools, documents) / eos ids
"""
