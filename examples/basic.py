"""Offline inference, vLLM style: generate completions for a batch of prompts.

Written as for vLLM; the only change is the import line (``from vllm import ...``).
MODEL is a local Hugging Face folder (the embedded tiny Qwen3), which vLLM loads too.
"""

from pathlib import Path

from mrv2 import LLM, SamplingParams

MODEL = str(Path(__file__).resolve().parents[1] / "mrv2" / "assets" / "tiny-qwen3-shakespeare")

prompts = [
    "ROMEO:",
    "JULIET:\nO Romeo,",
    "First Citizen:\nBefore we proceed",
    "KING RICHARD III:\nNow is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)


def main():
    llm = LLM(model=MODEL)
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
