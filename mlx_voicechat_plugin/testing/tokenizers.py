"""Deterministic tokenizers for fixture checkpoints.

Two vocabularies are trained from one embedded English corpus:

* the LLM tokenizer, a byte-level BPE (Hugging Face ``tokenizers``) laid out like
  the Nemotron-H one: ``<unk>``/``<s>``/``</s>`` at 0..2, multi-character special
  tokens after them (the silence and pad ids among them), the 256-symbol
  byte-level alphabet, then learned merges up to ``vocab_size``;
* the RNNT SentencePiece model whose pieces become ``config["rnnt_vocabulary"]``.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path


UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# The byte-level pre-tokenizer's marker for "this word follows a space".
WORD_START_MARKER = "\u0120"  # 'Ġ'
BYTE_ALPHABET_SIZE = 256

_CORPUS = """\
Hello world. Hello there, how are you doing today? I am doing well, thank you.
Good morning! Could you tell me what the weather will be like this afternoon?
It should be sunny and warm, with a light breeze coming from the west.
Please set a timer for ten minutes while the pasta is cooking on the stove.
The timer is set. I will let you know as soon as the ten minutes are over.
What time is it in Tokyo right now, and is it already tomorrow over there?
Can you remind me to call my sister when I get home from work tonight?
Sure, I will remind you to call your sister when you arrive at home.
Let us talk about something interesting, like the history of the moon landing.
In nineteen sixty nine, astronauts walked on the moon for the very first time.
The voice assistant listens and speaks at the same time, just like a person.
Full duplex conversation means that both sides may talk whenever they want.
Sometimes people interrupt each other, and a good listener simply adapts.
My favourite colour is blue, but I also like green, yellow and bright orange.
Would you like to hear a short story about a clever fox and a patient crow?
Once upon a time, a hungry fox saw a crow holding a piece of cheese.
The fox praised the crow's beautiful voice and asked her to sing a song.
When the crow opened her beak to sing, the cheese fell down to the ground.
Never trust flattery, said the crow, as the fox ran away with the cheese.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten.
Please turn on the lights in the kitchen and turn off the radio downstairs.
I cannot find my keys. Have you seen them near the door or on the table?
The train leaves the station at a quarter past eight every weekday morning.
Machine learning models learn patterns from data instead of explicit rules.
Speech recognition turns sound into text, and speech synthesis does the reverse.
A small model can still be useful when it runs quickly on a laptop computer.
Thank you very much for your help. You are welcome, have a wonderful evening!
Where is the nearest pharmacy, and is it open late on Sunday nights?
The museum opens at nine and closes at five, except on public holidays.
Reading books every night before sleeping is a calm and healthy habit.
Water boils at one hundred degrees and freezes at zero degrees Celsius.
The quick brown fox jumps over the lazy dog near the quiet river bank.
Pack your bags with five dozen liquor jugs, said the jovial quizmaster.
Spring brings flowers, summer brings heat, autumn brings leaves and rain.
Winter mornings are cold and dark, so a warm cup of tea feels wonderful.
Could you spell that word for me slowly, one letter at a time, please?
Engineers measure latency in milliseconds to keep the conversation natural.
Every frame of audio lasts eighty milliseconds in this streaming system.
The orchestra played a symphony while the audience listened in silence.
Mountains, oceans, forests and deserts cover the surface of our planet.
Scientists believe that regular exercise improves both memory and mood.
Shall we schedule the meeting for Thursday afternoon or Friday morning?
The recipe needs flour, sugar, butter, three eggs and a pinch of salt.
Bicycles are a cheap, quiet and efficient way to travel around the city.
I think the answer is forty two, although I am not completely certain.
Remember to drink enough water, especially on hot and humid summer days.
The library lends books, music, films and even tools to its members.
Birds migrate south for the winter and return north again in the spring.
Children laughed and played football in the park until the sun went down.
Kindly summarize yesterday's news in three short and simple sentences.
Jazz musicians improvise melodies, responding to each other in real time.
Elephants have excellent memories and live in close family groups.
Photographs capture a moment, but stories keep memories alive for years.
Quantum computers exploit superposition to explore many states at once.
Volcanoes erupt when pressure builds beneath the crust of the earth.
Gardening requires patience: seeds grow slowly into vegetables and fruit.
The committee approved the budget after a long and thoughtful discussion.
Zebras, giraffes and lions roam freely across the wide African savanna.
Voice, vision, knowledge, judgement, rhythm, harmony, exquisite jewellery.
"""


def corpus_lines() -> list[str]:
    """The embedded training corpus, one sentence a line."""
    return [line for line in _CORPUS.splitlines() if line.strip()]


def special_tokens(first_free_id: int) -> list[str]:
    """Names of the special tokens with ids ``0 .. first_free_id - 1``."""
    extra = [f"<SPECIAL_{i}>" for i in range(3, first_free_id)]
    return [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, *extra]


@dataclass(frozen=True)
class TextTokenizerFiles:
    """The contents of the LLM tokenizer files and the vocabulary they define."""

    tokenizer_json: str
    tokenizer_config: dict
    special_tokens_map: dict
    vocab: dict[str, int]


def _filler_tokens(vocab: dict[str, int], count: int) -> list[str]:
    """``count`` new byte-level word tokens (``Ġq`` + lower-case letters) not in ``vocab``."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    index = 0
    while len(out) < count:
        word, n = "", index
        while True:
            word = letters[n % 26] + word
            n //= 26
            if n == 0:
                break
        index += 1
        token = f"{WORD_START_MARKER}q{word}"
        if token not in vocab:
            out.append(token)
    return out


def build_text_tokenizer(
    vocab_size: int, bos_id: int, eos_id: int, silence_id: int, pad_id: int,
    fill: bool = False,
) -> TextTokenizerFiles:
    """Train the byte-level BPE on the embedded corpus up to ``vocab_size``.

    ``fill``: where the corpus runs out of merges first (the released model's
    131072-token vocabulary), the rest of the vocabulary is made of filler
    word tokens (``Ġqab`` ...) that decode and spell like words; encoding
    never produces them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    n_special = max(bos_id, eos_id, silence_id, pad_id) + 1
    specials = special_tokens(n_special)
    if specials[bos_id] != BOS_TOKEN or specials[eos_id] != EOS_TOKEN:
        raise ValueError("bos/eos ids must be 1 and 2 in the Nemotron layout")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    vocab = tokenizer.get_vocab()
    if fill and len(vocab) < vocab_size:
        layout = json.loads(tokenizer.to_str())
        start = len(layout["model"]["vocab"])
        for offset, token in enumerate(_filler_tokens(vocab, vocab_size - len(vocab))):
            layout["model"]["vocab"][token] = start + offset
        tokenizer = Tokenizer.from_str(json.dumps(layout))
        vocab = tokenizer.get_vocab()
    if len(vocab) != vocab_size:
        raise RuntimeError(
            f"BPE training reached {len(vocab)} tokens, expected {vocab_size}; "
            "the embedded corpus is too small"
        )
    single = [token for token in vocab if len(token) == 1]
    if len(single) != BYTE_ALPHABET_SIZE:
        raise RuntimeError(f"expected {BYTE_ALPHABET_SIZE} single-character tokens")

    names = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    names["pad_token"] = specials[pad_id]
    added = {
        str(idx): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for idx, token in enumerate(specials)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        **names,
    }
    return TextTokenizerFiles(
        tokenizer_json=tokenizer.to_str(pretty=True),
        tokenizer_config=tokenizer_config,
        special_tokens_map=dict(names),
        vocab=dict(sorted(vocab.items(), key=lambda item: item[1])),
    )


def write_text_tokenizer(files: TextTokenizerFiles, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``."""
    (out_dir / "tokenizer.json").write_text(files.tokenizer_json + "\n")
    for name, payload in (
        ("tokenizer_config.json", files.tokenizer_config),
        ("special_tokens_map.json", files.special_tokens_map),
    ):
        (out_dir / name).write_text(json.dumps(payload, indent=2) + "\n")


def _asr_sentences() -> list[str]:
    """Corpus normalized like ASR transcripts: lower case letters, apostrophes."""
    out = []
    for line in corpus_lines():
        text = re.sub(r"[^a-z' ]+", " ", line.lower())
        out.append(" ".join(text.split()))
    return out


def train_rnnt_sentencepiece(vocab_size: int, seed: int = 0) -> bytes:
    """Serialized SentencePiece BPE model with ``vocab_size`` pieces (``<unk>`` = 0)."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_asr_sentences()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        hard_vocab_limit=True,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return model.getvalue()


def sentencepiece_pieces(model_bytes: bytes) -> list[tuple[str, float]]:
    """``(piece, score)`` of a serialized SentencePiece model, by id."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    return [
        (processor.id_to_piece(i), processor.get_score(i))
        for i in range(processor.get_piece_size())
    ]


def write_rnnt_tokenizer(model_bytes: bytes, out_dir: Path) -> list[str]:
    """Write ``tokenizer.model`` + ``tokenizer.vocab``; return the pieces by id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(model_bytes)
    pieces = sentencepiece_pieces(model_bytes)
    lines = [f"{piece}\t{score:g}" for piece, score in pieces]
    (out_dir / "tokenizer.vocab").write_text("\n".join(lines) + "\n")
    return [piece for piece, _ in pieces]
