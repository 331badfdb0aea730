"""Prefill/decode disaggregation (`--kv-transfer-config`, issue 26): a prefill engine hands a
prompt's KV blocks to a decode engine over Mooncake's transfer engine. See docs/DISAGGREGATION.md."""
