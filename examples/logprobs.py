"""Log-probabilities, vLLM style: top-k logprobs of generated and prompt tokens.

Written as for vLLM; the only change is the import line (``from vllm import ...``).
"""

from pathlib import Path

from mrv2 import LLM, SamplingParams

MODEL = str(Path(__file__).resolve().parents[1] / "mrv2" / "assets" / "tiny-qwen3-shakespeare")


def main():
    llm = LLM(model=MODEL)
    sampling_params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    outputs = llm.generate(["ROMEO:", "JULIET:"], sampling_params)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt: {output.prompt!r}, generated: {completion.text!r}")
        print(f"Cumulative logprob: {completion.cumulative_logprob:.4f}")
        for token_id, top in zip(completion.token_ids, completion.logprobs):
            best = max(top.items(), key=lambda kv: kv[1].logprob)
            print(f"  token {token_id} logprob {top[token_id].logprob:.4f} "
                  f"(rank {top[token_id].rank}; top: {best[1].decoded_token!r})")
        first = output.prompt_logprobs[1]  # position 0 has none
        print(f"Prompt logprobs of the 2nd prompt token: {len(first)} entries")


if __name__ == "__main__":
    main()
