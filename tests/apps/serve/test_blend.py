"""``kvtier serve --blend``: segments found in requests, and blending over real HTTP in a real server process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from kvtier.apps.bench.launch import serve_processes
from kvtier.apps.serve.protocol import ChatRequest, CompletionRequest, parse
from kvtier.apps.serve.segmenter import NoSegments, Segmenter
from harness.serve import WORDS

DOC_A = " ".join(WORDS[:20])
DOC_B = " ".join(reversed(WORDS[5:30]))
DOC_C = " ".join(WORDS[10:] + WORDS[:4])


def messages(*docs: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "answer from the documents"},
            *({"role": "user", "content": doc} for doc in docs), {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_ids(tokenizer, msgs) -> list[int]:
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_each_message_but_the_last_is_a_segment(tokenizer):
    msgs = messages(DOC_A, DOC_B, question="rivers?")
    ids = chat_ids(tokenizer, msgs)
    spans = Segmenter(tokenizer).spans(parse(ChatRequest, {"messages": msgs}), ids)
    assert len(spans) == 3 and spans[0][0] == 0
    for (start, end), message in zip(spans, msgs):
        assert tokenizer.decode(ids[start:end]) == f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
    assert spans[-1][1] < len(ids)  # the question and the assistant's opener are computed
    # a document's tokens are the same wherever it sits: that is what its segment key covers
    other = chat_ids(tokenizer, messages(DOC_B, DOC_A, question="music?"))
    other_spans = Segmenter(tokenizer).chat(messages(DOC_B, DOC_A, question="music?"), other)
    a, b = spans[1], other_spans[2]
    assert ids[a[0]:a[1]] == other[b[0]:b[1]]


def test_a_template_that_rewrites_earlier_turns_gives_no_segments(tokenizer):
    rewriting = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if loop.last %}[{{ messages|length }}]"
                               "{% endif %}{% endfor %}")
    msgs = messages(DOC_A, question="q")
    ids = chat_ids(rewriting, msgs)
    assert Segmenter(rewriting).chat(msgs, ids) == ()


def test_a_chat_of_too_many_messages_gives_no_segments(tokenizer):
    from kvtier.core.segments import MAX_SEGMENTS as MAX_SEGMENT_MESSAGES

    many = messages(*[DOC_A] * MAX_SEGMENT_MESSAGES, question="q")  # 66 messages
    assert Segmenter(tokenizer).chat(many, chat_ids(tokenizer, many)) == ()
    fewer = many[:MAX_SEGMENT_MESSAGES - 1] + many[-1:]
    assert len(Segmenter(tokenizer).chat(fewer, chat_ids(tokenizer, fewer))) == MAX_SEGMENT_MESSAGES - 1


def test_text_prompts_split_at_the_separator_and_token_prompts_not_at_all(tokenizer):
    text = f"{DOC_A}\n\n{DOC_B}\n\nwhich rivers"
    ids = tokenizer.encode(text)
    segmenter = Segmenter(tokenizer, separator="\n\n")
    spans = segmenter.spans(parse(CompletionRequest, {"prompt": text}), ids)
    assert [tokenizer.decode(ids[s:e]).strip() for s, e in spans] == [DOC_A, DOC_B]
    assert segmenter.spans(parse(CompletionRequest, {"prompt": ids}), ids) == ()
    assert Segmenter(tokenizer).spans(parse(CompletionRequest, {"prompt": text}), ids) == ()  # no separator set
    assert NoSegments().spans(parse(CompletionRequest, {"prompt": text}), ids) == ()


@pytest.fixture(scope="module")
def deep_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's tokenizer with a 4-layer Llama: blending saves work only in layers after the check."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("deep-llama")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 4
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def usage(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json={"max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]


def test_kvtier_serve_blend_reuses_documents_in_any_order(deep_model_dir, tmp_path):
    args = ["--model", str(deep_model_dir), "--served-model-name", "tiny", "--chunk-size", "16",
            "--memory-bytes", "64MiB", "--blend", "--blend-ratio", "0.5", "--blend-separator", "\n\n",
            "--blend-max-deviation", "100"]  # random weights: the gate would rightly refuse to blend
    with serve_processes([("blend", args)], tmp_path) as (target,), httpx.Client(base_url=target.url, timeout=120) as c:
        first = usage(c, "/v1/chat/completions", {"messages": messages(DOC_A, DOC_B, DOC_C, question="rivers?")})
        assert first["blended_tokens"] == 0  # nothing cached yet: the documents get stored as segments
        again = usage(c, "/v1/chat/completions", {"messages": messages(DOC_C, DOC_A, DOC_B, question="music?")})
        assert again["blended_tokens"] > 0
        assert again["cached_tokens"] == 16  # reordered: no prefix beyond the system message's whole chunk
        texts = [usage(c, "/v1/completions", {"prompt": f"{DOC_B}\n\n{DOC_C}\n\n{q}"}) for q in ("weather", "cities")]
        assert texts[0]["blended_tokens"] == 0 and texts[1]["blended_tokens"] > 0
        metrics = c.get("/metrics").text
    blended = [line for line in metrics.splitlines() if line.startswith("kvtier_blend_blended_tokens_total ")]
    assert blended and float(blended[0].split()[1]) == again["blended_tokens"] + texts[1]["blended_tokens"]
    assert "# HELP kvtier_blend_recomputed_tokens_total" in metrics
    assert "kvtier_server_blended_prompt_tokens_total" in metrics


def test_blend_flags_build_the_blend_config():
    import argparse

    from kvtier.apps.serve.cli import add_parser, blend_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert blend_config(parser.parse_args(["serve"])) is None
    config = blend_config(parser.parse_args(["serve", "--blend", "--blend-ratio", "0.3", "--blend-max-deviation", "2"]))
    assert (config.recompute_ratio, config.max_deviation) == (0.3, 2.0)


def test_blend_needs_the_cache(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--model", str(tiny_model_dir), "--blend",
                          "--no-cache"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "needs the cache" in out.stderr


def test_a_text_of_too_many_separated_pieces_gives_no_segments(tokenizer):
    """Issue 29 B-1: ``"a\\n\\n" * 2000`` must not make 2000 segments (each a forward pass of its own)."""
    from kvtier.core.segments import MAX_SEGMENTS

    segmenter = Segmenter(tokenizer, separator="\n\n")
    hostile = "a\n\n" * 2000 + "Question: what?"
    assert segmenter.text(hostile, tokenizer.encode(hostile)) == ()
    fine = f"{DOC_A}\n\n" * MAX_SEGMENTS + "which rivers"
    assert len(segmenter.text(fine, tokenizer.encode(fine))) == MAX_SEGMENTS
