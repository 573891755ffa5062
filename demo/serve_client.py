"""The last step of `make demo`: requests to a running `qbuild serve` of a long-prompt VL bundle, sent through the
OpenAI client as a user sends them, printed, and written as a JSON document that `qbuild report --serve` shows.

1. A long prompt, twice. The first is prefilled cold, piece by piece; the second, the same prompt, resumes from the
   prefix cache at its deepest checkpoint before its last token. Each asks for one token, so the time it takes is the
   time to the first token as a client sees it (HTTP included); its usage's `prompt_tokens_details.cached_tokens`
   says how many prompt tokens the cache answered. A prompt of the same length goes first, unmeasured and sharing no
   prefix with them, so that neither measured request pays for loading the graphs it runs.
2. An image chat: a picture drawn here, sent as a data: URL image part before a question; the answer and its usage.

The demo's models are random, so the answers are noise; what they show is the path a request takes.

    python demo/serve_client.py BASE_URL [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys
import time

import openai

# The prompt's share of the KV cache: the rest is room for the answer.
PROMPT_SHARE = 7 / 8


def token_ids(n: int, seed: int) -> list[int]:
    """n ordinary token ids: byte tokens (ids below 256), which every byte-level BPE vocabulary of these models starts
    with, so no special or image token is among them."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def first_token(client: openai.OpenAI, model: str, ids: list[int]) -> dict:
    """One token after `ids`: how long it took (ms) and how many prompt tokens the prefix cache answered."""
    start = time.perf_counter()
    reply = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
    took = (time.perf_counter() - start) * 1e3
    details = reply.usage.prompt_tokens_details
    return {"ms": round(took, 2), "cached_tokens": details.cached_tokens if details else 0,
            "text": reply.choices[0].text}


def long_prompt(client: openai.OpenAI, model: str, max_prompt_tokens: int) -> dict:
    n = int(max_prompt_tokens * PROMPT_SHARE)
    first_token(client, model, token_ids(n, seed=1))   # loads every graph a prompt of this length runs through
    prompt = token_ids(n, seed=2)
    cold = first_token(client, model, prompt)
    warm = first_token(client, model, prompt)
    return {"tokens": n, "cold_ms": cold["ms"], "warm_ms": warm["ms"], "cold_cached_tokens": cold["cached_tokens"],
            "warm_cached_tokens": warm["cached_tokens"], "same_answer": cold["text"] == warm["text"]}


def picture(width: int, height: int) -> bytes:
    """A PNG: colour gradients with a bright square, something for the encoder to look at."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height))
    image.putdata([(x * 255 // width, y * 255 // height, 128) for y in range(height) for x in range(width)])
    ImageDraw.Draw(image).rectangle((width // 4, height // 4, width // 2, height // 2), fill=(250, 240, 80))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def image_chat(client: openai.OpenAI, model: str, size: tuple[int, int] = (128, 96)) -> dict:
    url = "data:image/png;base64," + base64.b64encode(picture(*size)).decode()
    question = "What is in this picture?"
    reply = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": question}]}])
    return {"size": list(size), "question": question, "answer": reply.choices[0].message.content,
            "prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--out", help="also write the results here, as JSON (for `qbuild report --serve`)")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=300)
    card = client.models.list().data[0]
    doc = {"model": card.id, "url": args.url,
           "long_prompt": long_prompt(client, card.id, card.model_extra["max_prompt_tokens"]),
           "image": image_chat(client, card.id)}
    lp, im = doc["long_prompt"], doc["image"]
    print(f"{card.id} over HTTP ({args.url}):")
    print(f"  a prompt of {lp['tokens']} tokens, cold: {lp['cold_ms']:.0f} ms to the first token, "
          f"cached_tokens {lp['cold_cached_tokens']}")
    print(f"  the same prompt, warm: {lp['warm_ms']:.0f} ms to the first token, cached_tokens "
          f"{lp['warm_cached_tokens']} ({lp['cold_ms'] / lp['warm_ms']:.1f}x faster"
          f"{', the same token' if lp['same_answer'] else ', A DIFFERENT TOKEN'})")
    print(f"  an image of {im['size'][0]}x{im['size'][1]} pixels and {im['question']!r}: {im['answer']!r} "
          f"({im['prompt_tokens']} prompt tokens, {im['completion_tokens']} generated)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0 if lp["same_answer"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
