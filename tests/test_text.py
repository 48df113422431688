"""Tests for parallel_lib.data and the corpus grammar behind it."""

import json
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import parallel_lib.data.corpus as corpus_module
import parallel_lib.data.tokenizer as tokenizer_module
from parallel_lib import data as text
from parallel_lib.data import _corpus_grammar as g
from parallel_lib.data import _corpus_lexicon as lex
from parallel_lib.data import collate_batch, get_tokenizer, load_corpus, load_hf_translation
from parallel_lib.data._corpus_grammar import ACC, Clause, english, german, noun, noun_phrase, pronoun, verb
from parallel_lib.data._corpus_templates import generate_pairs

VOCAB = 512  # the same as test_train's, so the in-memory cache trains it once per session


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(load_corpus("train"), vocab_size=VOCAB)


# --- the corpus ----------------------------------------------------------------------------

def test_splits_have_their_sizes_and_are_disjoint():
    splits = {split: load_corpus(split) for split in text.SPLITS}
    assert {s: len(pairs) for s, pairs in splits.items()} == {"train": 18_000, "validation": 1_000, "test": 1_000}
    german_sets = {s: {p["de"] for p in pairs} for s, pairs in splits.items()}
    assert sum(len(v) for v in german_sets.values()) == 20_000, "a German sentence appears twice"
    assert all(set(p) == {"de", "en"} and p["de"] and p["en"] for p in splits["test"])


def test_corpus_is_deterministic_and_callers_get_their_own_copy():
    first = load_corpus("validation")
    first[0]["de"] = "changed"
    assert load_corpus("validation")[0]["de"] != "changed"
    assert load_corpus("validation", size=5) == load_corpus("validation")[:5]
    assert load_corpus("train", size=0) == []


def test_generation_is_seeded_and_fast():
    start = time.perf_counter()
    pairs = generate_pairs(20_000, text.CORPUS_SEED)
    seconds = time.perf_counter() - start
    assert pairs == list(corpus_module._corpus_pairs())  # the same corpus in any process
    assert generate_pairs(50, 1) != pairs[:50]
    assert seconds < 6, f"generating the corpus took {seconds:.1f} s (about 1 s on an idle laptop)"


@pytest.mark.parametrize("kwargs, match", [(dict(split="dev"), "split must be one of"),
                                           (dict(size=-1), "size must be in 0..18000"),
                                           (dict(split="test", size=1001), "size must be in 0..1000")])
def test_load_corpus_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_corpus(**kwargs)


def test_corpus_is_varied_natural_text():
    pairs = [(p["de"], p["en"]) for p in load_corpus("train")]
    words_de = {w for de, _ in pairs for w in re.findall(r"\w+", de)}
    words_en = {w for _, en in pairs for w in re.findall(r"\w+", en)}
    assert len(words_de) > 1200 and len(words_en) > 800
    share = {mark: sum(mark in de for de, _ in pairs) / len(pairs)
             for mark in ("?", "!", ", dass ", ", weil ", "Wenn ", " gibt es ", " nicht ", " kein")}
    assert all(s > 0.01 for s in share.values()), share
    mean_words = sum(len(de.split()) for de, _ in pairs) / len(pairs)
    assert 5 < mean_words < 12
    for de, en in pairs:
        for sentence in (de, en):
            assert sentence[0].isupper() and sentence[-1] in ".?!" and "  " not in sentence, sentence
        assert not re.search(r"\ba [aeio]|\ban [^aeiou]", en, re.IGNORECASE), en  # a/an


def _verb_forms() -> tuple[set[str], set[str]]:
    """(finite forms, every form that may end a German clause) of the lexicon's verbs."""
    finite = {f for forms in (*lex.PRESENT.values(), *lex.PAST.values()) for f in forms}
    finite |= {f for forms, _, _ in lex.MODALS.values() for f in forms}
    finite |= {f for v in g.VERBS for f in v.pres}
    final = finite | {v.prefix + f for v in g.VERBS for f in v.pres} | {v.part for v in g.VERBS}
    return finite, final | {v.inf for v in g.VERBS} | {"regnet", "schneit", "scheint"}


def test_subordinate_clauses_end_with_the_verb_and_wenn_inverts_the_main_clause():
    finite, final = _verb_forms()
    pairs = load_corpus("train")
    dass = [p["de"] for p in pairs if ", dass " in p["de"]]
    wenn = [p["de"] for p in pairs if p["de"].startswith("Wenn ")]
    assert len(dass) > 200 and len(wenn) > 200
    for de in dass:  # "..., dass der Mann den Apfel gegessen hat."
        assert de[:-1].split()[-1] in final, de
    for de in wenn:  # "Wenn es regnet, bleibt der Mann zu Hause."
        condition, main = de.split(", ", 1)
        assert condition.split()[-1] in final and main.split()[0] in finite, de


@pytest.mark.parametrize("word, det, plural, adj, number, cases, en", [
    ("Mann", "def", False, "groß", None, ("der große Mann", "den großen Mann", "dem großen Mann"), "the big man"),
    ("Frau", "ein", False, "alt", None, ("eine alte Frau", "eine alte Frau", "einer alten Frau"), "a old woman"),
    ("Auto", "ein", False, "teuer", None, ("ein teures Auto", "ein teures Auto", "einem teuren Auto"), "a expensive car"),
    ("Kind", "num", True, None, ("zwei", "two"), ("zwei Kinder", "zwei Kinder", "zwei Kindern"), "two children"),
    ("Junge", "def", False, None, None, ("der Junge", "den Jungen", "dem Jungen"), "the boy"),
    ("Milch", "ein", False, "kalt", None, ("kalte Milch", "kalte Milch", "kalter Milch"), "cold milk"),
    ("Hund", "kein", False, "müde", None, ("kein müder Hund", "keinen müden Hund", "keinem müden Hund"), "a tired dog"),
    ("Frau", "poss", False, None, ("mein", "my"), ("meine Frau", "meine Frau", "meiner Frau"), "my wife"),
    ("Haus", "dies", True, "alt", None, ("diese alten Häuser", "diese alten Häuser", "diesen alten Häusern"),
     "these old houses"),
])
def test_noun_phrases_decline_for_case_gender_and_determiner(word, det, plural, adj, number, cases, en):
    np = noun_phrase(noun(word), det, plural, g.adjective(adj) if adj else None, number)
    assert (np.de, np.en) == (cases, en)


def test_present_tense_conjugation():
    assert g.present("arbeiten") == ("arbeite", "arbeitest", "arbeitet", "arbeiten", "arbeitet", "arbeiten")
    assert verb("essen").pres == ("esse", "isst", "isst", "essen", "esst", "essen")
    assert verb("fahren", "drive").pres[1:3] == ("fährst", "fährt")
    assert verb("öffnen").pres[2] == "öffnet" and verb("tanzen").pres[1] == "tanzt"
    assert verb("einladen").pres[1:3] == ("lädst", "lädt") and verb("einladen").prefix == "ein"


def test_clauses_in_every_word_order():
    man, apple = noun_phrase(noun("Mann")), noun_phrase(noun("Apfel"))
    c = Clause(man, verb("essen"), acc=apple)
    assert (german(c), english(c)) == ("der Mann isst den Apfel", "the man eats the apple")
    assert (german(c, "question"), english(c, "question")) == ("isst der Mann den Apfel", "does the man eat the apple")
    assert german(c, "sub") == "der Mann den Apfel isst"
    past = Clause(man, verb("essen"), "past", acc=apple)
    assert (german(past), english(past)) == ("der Mann hat den Apfel gegessen", "the man ate the apple")
    assert german(past, "sub") == "der Mann den Apfel gegessen hat"
    wants = Clause(man, verb("essen"), "wollen", acc=apple)
    assert (german(wants), english(wants)) == ("der Mann will den Apfel essen", "the man wants to eat the apple")
    cannot = Clause(man, verb("essen"), "können", acc=apple, neg=True)
    assert (german(cannot), english(cannot)) == ("der Mann kann den Apfel nicht essen", "the man cannot eat the apple")
    kein = Clause(man, verb("essen"), acc=noun_phrase(noun("Apfel"), "kein"), neg=True)
    assert (g.sentence(german(kein), "."), g.sentence(english(kein), ".")) == (
        "Der Mann isst keinen Apfel.", "The man does not eat an apple.")
    today = Clause(man, verb("essen"), acc=apple, time=("heute", "today"), front_time=True)
    assert (german(today), english(today)) == ("heute isst der Mann den Apfel", "today the man eats the apple")


def test_separable_verbs_perfect_with_sein_and_two_way_prepositions():
    call = Clause(pronoun(0), verb("anrufen"), acc=noun_phrase(noun("Lehrerin")))
    assert (german(call), german(call, "sub")) == ("ich rufe die Lehrerin an", "ich die Lehrerin anrufe")
    assert english(call) == "I call the teacher"
    park = noun_phrase(noun("Park"))
    assert (g.prep_phrase("in", park), g.prep_phrase("in", park, ACC)) == ("im Park", "in den Park")
    assert g.prep_phrase("zu", noun_phrase(noun("Schule"))) == "zur Schule"
    went = Clause(noun_phrase(noun("Kind")), verb("gehen"), "past", place=("in den Park", "to the park"))
    assert (german(went), english(went)) == ("das Kind ist in den Park gegangen", "the child went to the park")


def test_imperatives():
    c = Clause(pronoun(1), verb("essen"), acc=noun_phrase(noun("Apfel")))
    assert g.imperative(c, 0, please=True) == ("Iss bitte den Apfel!", "Please eat the apple!")
    assert g.imperative(c, 2, please=False) == ("Essen Sie den Apfel!", "Eat the apple!")
    call = Clause(pronoun(1), verb("anrufen"), acc=noun_phrase(noun("Arzt")), neg=True)
    assert g.imperative(call, 1, please=False) == ("Ruft den Arzt nicht an!", "Do not call the doctor!")


# --- Hugging Face loader -------------------------------------------------------------------

def _fake_datasets(calls: list) -> types.ModuleType:
    """A stand-in ``datasets`` module that reads ``<path>/<split>.json`` files written by the test."""
    module = types.ModuleType("datasets")

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        rows = json.loads((Path(path) / f"{split}.json").read_text())
        return {"translation": [row["translation"] for row in rows]}

    module.load_dataset = load_dataset
    return module


def test_load_hf_translation_reads_the_translation_column(tmp_path, monkeypatch):
    rows = [{"translation": {"de": f"Satz {i}.", "en": f"Sentence {i}.", "fr": f"Phrase {i}."}} for i in range(3)]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(calls))
    pairs = load_hf_translation(str(tmp_path), "train", config="de-en", size=2, cache_dir="cache")
    assert pairs == [{"de": "Satz 0.", "en": "Sentence 0."}, {"de": "Satz 1.", "en": "Sentence 1."}]
    assert calls == [(str(tmp_path), "de-en", "train", {"cache_dir": "cache"})]
    assert load_hf_translation(str(tmp_path), "train", src_key="en", tgt_key="fr")[2] == {
        "en": "Sentence 2.", "fr": "Phrase 2."}
    with pytest.raises(KeyError, match="src_key='es'"):
        load_hf_translation(str(tmp_path), "train", src_key="es")


def test_load_hf_translation_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes "import datasets" fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[datasets\]'"):
        load_hf_translation("wmt14", "train", config="de-en")


# --- tokenizer -----------------------------------------------------------------------------

def test_tokenizer_has_pad_and_eos_and_round_trips_any_text(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert 300 < len(tokenizer) <= VOCAB
    for sentence in [p["de"] for p in load_corpus("test", 20)] + ["Grüße aus Köln: 3 × 4 € 😀"]:
        ids = tokenizer.encode(sentence, add_special_tokens=False)
        assert tokenizer.decode(ids) == sentence and text.PAD_TOKEN not in tokenizer.decode(ids)


def test_tokenizer_save_and_reload(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    sentences = [p["en"] for p in load_corpus("validation", 10)]
    assert reloaded(sentences)["input_ids"] == tokenizer(sentences)["input_ids"]
    assert (reloaded.pad_token_id, reloaded.eos_token_id, len(reloaded)) == (0, 1, len(tokenizer))


def test_tokenizer_training_is_cached_and_vocab_size_matters(tokenizer):
    hits = tokenizer_module._train_bpe.cache_info().hits
    again = get_tokenizer(load_corpus("train"), vocab_size=VOCAB)
    assert tokenizer_module._train_bpe.cache_info().hits == hits + 1 and again is not tokenizer
    small = get_tokenizer(load_corpus("train", 2000), vocab_size=300)
    sentence = load_corpus("test")[0]["de"]
    assert len(small.encode(sentence)) > len(tokenizer.encode(sentence))


def test_get_tokenizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 258"):
        get_tokenizer(load_corpus("test"), vocab_size=100)
    with pytest.raises(ValueError, match="at least one pair"):
        get_tokenizer([], vocab_size=512)
    with pytest.raises(KeyError, match="fr"):
        get_tokenizer(load_corpus("test"), vocab_size=512, tgt_key="fr")


# --- collate_batch -------------------------------------------------------------------------

def _encode(tokenizer, sentence):
    return tokenizer.encode(sentence, add_special_tokens=False)


def test_collate_shifts_pads_and_weights_exactly_the_target(tokenizer):
    examples = [{"de": "Der Hund schläft.", "en": "The dog sleeps."},
                {"de": "Ja.", "en": "Yes, the child is reading a very long book today."}]
    batch = collate_batch(examples, "de", "en", tokenizer, model_max_length=64)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = [_encode(tokenizer, e["de"]) + [eos] + _encode(tokenizer, e["en"]) + [eos] for e in examples]
    width = max(map(len, seqs)) - 1
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "input_ids": ((2, width), torch.long), "labels": ((2, width), torch.long),
        "label_token_weights": ((2, width), torch.float32)}
    for row, (example, seq) in enumerate(zip(examples, seqs)):
        src, tgt, n = _encode(tokenizer, example["de"]), _encode(tokenizer, example["en"]), len(seq) - 1
        assert batch["input_ids"][row, :n].tolist() == seq[:-1]
        assert batch["labels"][row, :n].tolist() == seq[1:]  # labels[t] is the token after input_ids[t]
        weights = batch["label_token_weights"][row]
        assert weights[:n].tolist() == [0.0] * len(src) + [1.0] * (len(tgt) + 1)
        assert batch["labels"][row][weights.bool()].tolist() == tgt + [eos]  # the target and its eos only
        assert batch["input_ids"][row, n:].eq(pad).all() and batch["labels"][row, n:].eq(pad).all()
        assert weights[n:].eq(0).all()


def test_collate_truncates_to_model_max_length(tokenizer):
    example = {"de": "Der Mann isst den Apfel.", "en": "The man eats the apple."}
    src, tgt = _encode(tokenizer, example["de"]), _encode(tokenizer, example["en"])
    seq = src + [tokenizer.eos_token_id] + tgt + [tokenizer.eos_token_id]
    limit = len(src) + 3  # keeps the separator and the first target tokens
    batch = collate_batch([example], "de", "en", tokenizer, model_max_length=limit)
    assert batch["input_ids"][0].tolist() == seq[:limit] and batch["labels"][0].tolist() == seq[1:limit + 1]
    assert batch["label_token_weights"][0].tolist() == [0.0] * len(src) + [1.0] * 3
    source_only = collate_batch([example], "de", "en", tokenizer, model_max_length=len(src) - 1)
    assert source_only["label_token_weights"].sum() == 0  # the target was cut off entirely


def test_collate_can_pad_to_model_max_length_and_place_tensors(tokenizer):
    examples = load_corpus("test", 4)
    batch = collate_batch(examples, "de", "en", tokenizer, 100, pad_to_max_length=True)
    assert all(v.shape == (4, 100) for v in batch.values())
    on_meta = collate_batch(examples, "de", "en", tokenizer, 100, device="meta")
    assert {v.device.type for v in on_meta.values()} == {"meta"}
    assert {v.device.type for v in collate_batch(examples, "de", "en", tokenizer, 100).values()} == {"cpu"}


def test_collate_rejects_bad_arguments(tokenizer):
    examples = load_corpus("test", 2)
    with pytest.raises(ValueError, match="at least one pair"):
        collate_batch([], "de", "en", tokenizer, 64)
    with pytest.raises(ValueError, match="model_max_length must be an int >= 1, got model_max_length=0"):
        collate_batch(examples, "de", "en", tokenizer, 0)
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token=text.EOS_TOKEN)
    with pytest.raises(ValueError, match="pad_token_id=None"):
        collate_batch(examples, "de", "en", no_pad, 64)
