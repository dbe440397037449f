"""Offline chat, vLLM style: ``LLM.chat`` renders conversations with the chat template.

Written as for vLLM; the only change is the import line (``from vllm import ...``).
"""

from pathlib import Path

from mrv2 import LLM, SamplingParams

MODEL = str(Path(__file__).resolve().parents[1] / "mrv2" / "assets" / "tiny-qwen3-shakespeare")


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


def main():
    llm = LLM(model=MODEL)
    sampling_params = SamplingParams(temperature=0.5, max_tokens=16, seed=0)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # A batch of conversations in one call.
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)


if __name__ == "__main__":
    main()
