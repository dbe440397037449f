"""Prompts given as token ids, vLLM style: ``TokensPrompt`` and text prompts in one batch.

Written as for vLLM; the only change is the import lines (``from vllm import ...``,
``from vllm.inputs import ...``).
"""

from pathlib import Path

from mrv2 import LLM, SamplingParams
from mrv2.inputs import TextPrompt, TokensPrompt

MODEL = str(Path(__file__).resolve().parents[1] / "mrv2" / "assets" / "tiny-qwen3-shakespeare")


def main():
    llm = LLM(model=MODEL)
    tokenizer = llm.get_tokenizer()
    prompts = [
        TokensPrompt(prompt_token_ids=tokenizer.encode("ROMEO:")),
        TextPrompt(prompt="JULIET:"),
        {"prompt_token_ids": tokenizer.encode("MERCUTIO:")},
    ]
    sampling_params = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt token ids: {output.prompt_token_ids}")
        print(f"Generated token ids: {output.outputs[0].token_ids}")
        print(f"Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
