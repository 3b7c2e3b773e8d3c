"""End-to-end runs on the full-size random model: prefill and decode, multi-turn reuse."""
