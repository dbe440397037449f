"""vLLM's basic offline-inference script, unchanged but for the import.

Run: python examples/offline_inference.py [--model PATH]
With vLLM installed, `from vllm import LLM, SamplingParams` runs the same script.
"""

import argparse

from mrv2 import LLM, SamplingParams  # from vllm import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="HF folder (default: mrv2's embedded model)")
args = parser.parse_args()

prompts = [
    "ROMEO:",
    "JULIET:",
    "First Citizen:",
    "KING RICHARD III:",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)

llm = LLM(model=args.model, max_model_len=256) if args.model else LLM(max_model_len=256)
outputs = llm.generate(prompts, sampling_params)

print("\nGenerated Outputs:\n" + "-" * 60)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt:    {prompt!r}")
    print(f"Output:    {generated_text!r}")
    print("-" * 60)
