"""The grammar that turns ``_corpus_lexicon`` into German→English sentence pairs.

Why a generator rather than a shipped file: ~220 nouns, ~80 verb senses and a few
dozen rules give tens of thousands of distinct, grammatical pairs in about a second,
offline, and every rule can be read and tested here. The German side has what a
translation model must learn and a word-by-word copy cannot do: case and gender of
articles and adjectives (weak, mixed and strong endings), n-declension, verb-second
order, verb-final subordinate clauses, separable verbs, the Perfekt with haben/sein,
modal verbs, kein vs nicht, questions, imperatives and two-way prepositions (im Park /
in den Park). The English side adds do-support, third-person -s and a/an.

Used through ``parallel_lib.data.load_corpus``; nothing here is public API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from parallel_lib.data import _corpus_lexicon as lex

__all__: list[str] = []

NOM, ACC, DAT = 0, 1, 2
Pair = tuple[str, str]  # (German, English)
# articles and endings by key (m/f/n/pl) and case; "dieser" takes the strong endings
DEF = {"m": ("der", "den", "dem"), "f": ("die", "die", "der"), "n": ("das", "das", "dem"), "pl": ("die", "die", "den")}
EIN = {"m": ("", "en", "em"), "f": ("e", "e", "er"), "n": ("", "", "em"), "pl": ("e", "e", "en")}
WEAK = {"m": ("e", "en", "en"), "f": ("e", "e", "en"), "n": ("e", "e", "en"), "pl": ("en", "en", "en")}
MIXED = {"m": ("er", "en", "en"), "f": ("e", "e", "en"), "n": ("es", "es", "en"), "pl": ("en", "en", "en")}
STRONG = {"m": ("er", "en", "em"), "f": ("e", "e", "er"), "n": ("es", "es", "em"), "pl": ("e", "e", "en")}
CONTRACT = {("in", "dem"): "im", ("an", "dem"): "am", ("zu", "dem"): "zum", ("zu", "der"): "zur",
            ("in", "das"): "ins", ("an", "das"): "ans"}
EN_BE = (("am", "are", "is", "are", "are", "are"), ("was", "were", "was", "were", "were", "were"))
# stems that need an -e- before -st/-t: arbeit-est, find-et, öffn-et, zeichn-et (not lern-t, wohn-t)
_E_INSERT = re.compile(r"([td]|(?:[^aeiouäöülrhmn]|ch)[mn])$")


@dataclass(frozen=True)
class Noun:
    gender: str
    sg: str
    pl: str | None  # None: mass noun (Wasser) without plural or "ein"
    en_sg: str
    en_pl: str | None
    tags: frozenset[str]
    loc: tuple[str, str] = ("in", "in")  # place nouns: German and English preposition of location
    dir: str = "in"  # place nouns: German preposition of direction (English: "to")

    def de(self, case: int, plural: bool) -> str:
        if plural:  # dative plural adds -n: den Kindern (not den Autos, den Frauen)
            return self.pl + "n" if case == DAT and not self.pl.endswith(("n", "s")) else self.pl  # type: ignore
        return self.pl if case != NOM and "weak" in self.tags else self.sg  # type: ignore  # den Jungen


@dataclass(frozen=True)
class Adjective:
    pred: str
    stem: str  # attributive stem: teuer -> ein teures Auto
    en: str
    comp: str | None
    en_comp: str | None
    tags: frozenset[str]


@dataclass(frozen=True)
class Verb:
    inf: str
    prefix: str  # separable prefix: an|rufen -> "ruft ... an"
    pres: tuple[str, ...]  # ich, du, er, wir, ihr, sie; without the separable prefix
    imp: str  # du-imperative: iss, öffne, fahr
    part: str  # "-": no Perfekt (haben: Präteritum hatte)
    aux: str
    en: str
    en_past: str
    subj: frozenset[str]
    frame: dict[str, frozenset[str]]  # acc, dat, place, place!, dir, transport, with, manner


@dataclass(frozen=True)
class NP:
    de: tuple[str, str, str]  # nominative, accusative, dative
    en: str  # subject form
    en_obj: str  # object form (differs for pronouns only)
    person: int  # conjugation row: 0 ich, 1 du, 2 er/sie/es, 3 wir, 4 ihr, 5 sie
    key: str  # m/f/n/pl, or the pronoun itself
    pron: Pair  # pronoun that refers back to it
    human: bool = False  # asked for with wer/wen/wem ("who"), else was ("what")
    kein: bool = False  # negated by its determiner, so the clause needs no "nicht"
    contractible: bool = False  # starts with der/die/das: "in dem" -> "im"


def present(base: str, changed: str | None = None) -> tuple[str, ...]:
    """Present tense (ich, du, er, wir, ihr, sie); ``changed``: the du/er stem of a vowel-changing verb."""
    if base in lex.PRESENT:
        return lex.PRESENT[base]
    stem = base[:-2] if base.endswith("en") else base[:-1]  # füttern -> fütter
    e = "e" if _E_INSERT.search(stem) else ""
    hiss = ("s", "ß", "z", "x")
    if changed:  # vowel change in du/er, and no -e-: du lädst, er lädt, er hält
        du, er = changed + ("t" if changed.endswith(hiss) else "st"), changed + ("" if changed.endswith("t") else "t")
    else:
        du, er = stem + e + ("t" if stem.endswith(hiss) else "st"), stem + e + "t"
    return stem + "e", du, er, base, stem + e + "t", base


def _parse_verb(line: str) -> Verb:
    inf, changed, part, aux, en, en_past, subj, frame_text = line.split("|")
    frame = {k: frozenset(v.split(",")) if v else frozenset()
             for k, _, v in (item.partition(":") for item in frame_text.split())}
    prefix = next(iter(frame.pop("sep", ())), "")
    base, changed_stem = inf[len(prefix):], None if changed == "-" else changed
    stem = base[:-2] if base.endswith("en") else base[:-1]
    if changed_stem and "ä" not in changed_stem:  # e->i verbs keep it: gib, iss, lies, nimm
        imp = changed_stem
    else:
        imp = stem + "e" if _E_INSERT.search(stem) or base.endswith(("ern", "eln")) else stem
    return Verb(inf, prefix, present(base, changed_stem), imp, part, aux, en, en_past,
                frozenset(subj.split()), frame)


def _parse_noun(line: str) -> Noun:
    gender, sg, pl, en_sg, en_pl, tag_text = line.split("|")
    tags = tag_text.split()
    loc = next((tuple(t[1:].split(":")) for t in tags if t.startswith("@")), ("in", "in"))
    dir_ = next((t[1:] for t in tags if t.startswith(">")), "in")
    return Noun(gender, sg, None if pl == "-" else pl, en_sg, None if en_pl == "-" else en_pl,
                frozenset(tags), loc, dir_)  # type: ignore[arg-type]


def _parse_adjective(line: str) -> Adjective:
    forms, en, comp, en_comp, tags = line.split("|")
    pred, _, stem = forms.partition("/")
    # müde -> den müden Mann (stem without its final -e)
    return Adjective(pred, stem or pred.removesuffix("e"), en, None if comp == "-" else comp,
                     None if en_comp == "-" else en_comp, frozenset(tags.split()))


def _lines(table: str) -> list[str]:
    return [line for line in table.strip().splitlines() if line and not line.startswith("#")]


NOUNS = [_parse_noun(line) for line in _lines(lex.NOUNS)]
ADJECTIVES = [_parse_adjective(line) for line in _lines(lex.ADJECTIVES)]
VERBS = [_parse_verb(line) for line in _lines(lex.VERBS)]


@lru_cache(maxsize=None)
def nouns_with(tags: frozenset[str]) -> tuple[Noun, ...]:
    return tuple(n for n in NOUNS if n.tags & tags)


@lru_cache(maxsize=None)
def adjectives_for(noun: Noun) -> tuple[Adjective, ...]:
    return tuple(a for a in ADJECTIVES if a.tags & noun.tags)


def noun(word: str) -> Noun:
    """The lexicon entry of a German singular noun (for tests and examples)."""
    return next(n for n in NOUNS if n.sg == word)


def verb(inf: str, en: str | None = None) -> Verb:
    """The lexicon entry of a German infinitive, optionally of one English sense."""
    return next(v for v in VERBS if v.inf == inf and en in (None, v.en))


def adjective(word: str) -> Adjective:
    return next(a for a in ADJECTIVES if a.pred == word)


def noun_phrase(n: Noun, det: str = "def", plural: bool = False, adj: Adjective | None = None,
                word: Pair | None = None) -> NP:
    """German (3 cases) and English noun phrase; det: def, dies, ein, kein, zero, num, poss (word: its pair)."""
    if n.pl is None:  # mass noun: "Wasser", never "ein Wasser"
        plural, det = False, "zero" if det in ("ein", "num") else det
    plural = plural or det == "num"
    if plural and det == "ein":
        det = "zero"
    key = "pl" if plural else n.gender
    if det == "def":
        arts, ends, en_det = DEF[key], WEAK, "the"
    elif det == "dies":
        arts, ends, en_det = tuple("dies" + e for e in STRONG[key]), WEAK, "these" if plural else "this"
    elif det in ("ein", "kein", "poss"):  # never plural "ein": that became "zero" above
        arts, ends = tuple((word[0] if det == "poss" else det) + e for e in EIN[key]), MIXED  # type: ignore[index]
        en_det = word[1] if det == "poss" else "a" if not plural and n.pl else ""  # type: ignore[index]
    else:  # zero or a number: adjectives take the strong endings (kalte Milch, zwei große Hunde)
        arts, ends = (word[0],) * 3 if det == "num" else ("", "", ""), STRONG  # type: ignore[index]
        en_det = word[1] if det == "num" else ""  # type: ignore[index]
    de = tuple(" ".join(w for w in (arts[c], adj.stem + ends[key][c] if adj else "", n.de(c, plural)) if w)
               for c in (NOM, ACC, DAT))
    en_noun = n.en_pl if plural else n.en_sg
    if det == "poss" and n.sg in lex.POSSESSED:  # "meine Frau" = "my wife"
        en_noun = lex.POSSESSED[n.sg][plural]
    en = " ".join(w for w in (en_det, adj.en if adj else "", en_noun) if w)
    pron = ("sie", "they") if plural else ({"m": "er", "f": "sie", "n": "es"}[n.gender],
                                           "he" if "he" in n.tags else "she" if "she" in n.tags else "it")
    return NP(de, en, en, 5 if plural else 2, key, pron, "person" in n.tags,  # type: ignore[arg-type]
              det == "kein", det == "def" and not plural)


def pronoun(index: int) -> NP:
    nom, acc, dat, en, en_obj, person = lex.PRONOUNS[index]
    return NP((nom, acc, dat), en, en_obj, person, nom, (nom, en), human=index != 4)


def name(de: str, pron_en: str) -> NP:
    return NP((de,) * 3, de, de, 2, "m" if pron_en == "he" else "f", ("er" if pron_en == "he" else "sie", pron_en),
              human=True)


WHO = NP(("wer", "wen", "wem"), "who", "who", 2, "wer", ("er", "he"), human=True)
WHAT = NP(("was", "was", "was"), "what", "what", 2, "was", ("es", "it"))


def prep_phrase(prep: str, np: NP, case: int = DAT) -> str:
    """German prepositional phrase with the usual contraction: in dem Park -> im Park."""
    first, _, rest = np.de[case].partition(" ")
    if np.contractible and (prep, first) in CONTRACT:
        return f"{CONTRACT[prep, first]} {rest}"
    return f"{prep} {np.de[case]}"


def third_person(phrase: str) -> str:
    """English -s on the first word: eat -> eats, watch TV -> watches TV, have -> has."""
    word, _, rest = phrase.partition(" ")
    if word == "have":
        word = "has"
    elif word.endswith(("s", "sh", "ch", "x", "z", "o")):
        word += "es"
    elif word.endswith("y") and word[-2] not in "aeiou":
        word = word[:-1] + "ies"
    else:
        word += "s"
    return f"{word} {rest}".strip()


@dataclass(frozen=True)
class Clause:
    """One clause, realised as German and English in any word order (see ``german``/``english``)."""

    subj: NP
    verb: Verb | None = None  # None: the copula "sein"
    tense: str = "present"  # "present", "past" (Perfekt; Präteritum for sein/haben) or a key of lex.MODALS
    acc: NP | None = None
    dat: NP | None = None
    pred: Pair | None = None  # complement of sein: an adjective or a place
    neg: bool = False
    time: Pair | None = None
    freq: Pair | None = None
    gern: bool = False  # "isst gern" = "likes to eat"
    manner: Pair | None = None
    comp: Pair | None = None  # "mit dem Hund" = "with the dog"
    transport: Pair | None = None  # "mit dem Zug" = "by train"
    place: Pair | None = None  # location or direction
    front_time: bool = False  # "Heute isst der Mann ..." = "Today the man eats ..."


def _de_verb(c: Clause) -> tuple[str, list[str]]:
    """The finite verb and what goes to the end: separable prefix, participle or infinitive."""
    p, v = c.subj.person, c.verb
    if v is None or (v.part == "-" and c.tense == "past"):
        return (lex.PAST if c.tense == "past" else lex.PRESENT)["sein" if v is None else "haben"][p], []
    if c.tense == "present":
        return v.pres[p], [v.prefix] if v.prefix else []
    if c.tense == "past":
        return lex.PRESENT[v.aux][p], [v.part]
    return lex.MODALS[c.tense][0][p], [v.inf]


def _de_middle(c: Clause, time: bool = True) -> list[str]:
    """German middle field: time, dative, frequency, accusative, nicht, manner, with, transport, place."""
    nicht = "nicht" if c.neg and not (c.acc and c.acc.kein) else ""
    words = [c.time[0] if c.time and time else "", c.dat.de[DAT] if c.dat else "", c.freq[0] if c.freq else "",
             "gern" if c.gern else "", c.acc.de[ACC] if c.acc else "", nicht]
    return words + [x[0] if x else "" for x in (c.manner, c.comp, c.transport, c.place, c.pred)]


def german(c: Clause, form: str = "statement", wh: str = "", front: str = "") -> str:
    """form: statement (verb second, after ``front`` if given), question (verb first, after ``wh``), sub (verb last)."""
    finite, end = _de_verb(c)
    subj = c.subj.de[NOM]
    if form == "sub":  # verb last; a separable verb joins again: "dass er sie anruft"
        last = [end[0] + finite] if c.tense == "present" and end else [*end, finite]
        words = [subj, *_de_middle(c), *last]
    elif form == "question":
        words = [wh, finite, subj, *_de_middle(c), *end]
    elif front or (c.front_time and c.time):
        words = [front or c.time[0], finite, subj, *_de_middle(c, time=bool(front)), *end]  # type: ignore[index]
    else:
        words = [subj, finite, *_de_middle(c), *end]
    return " ".join(w for w in words if w)


def _en_verb(c: Clause, question: bool) -> tuple[str, list[str]]:
    """English verb group: (auxiliary put before the subject in a question, words after the subject)."""
    p, third, past, freq = c.subj.person, c.subj.person == 2, c.tense == "past", c.freq[1] if c.freq else ""
    if c.verb is None:
        be = EN_BE[past][p]
        return (be, ["not"] * c.neg + [freq]) if question else ("", [be, *["not"] * c.neg, freq])
    main = c.verb.en
    if c.tense in lex.MODALS:
        _, kind, modal = lex.MODALS[c.tense]
        if kind == "modal":  # can, may, should, would like to: no do-support
            aux, _, to = modal.partition(" ")
            main = f"{to} {main}".strip()
            if question:
                return aux, [main]
            return "", (["cannot"] if c.neg and aux == "can" else [aux, "not"] if c.neg else [aux]) + [main]
        main = f"{modal} {main}"  # want to, have to: do-support like any verb
    if c.gern:
        main = "like to " + main
    if c.neg or question:
        do = "did" if past else "does" if third else "do"
        return (do, [freq, main]) if question else ("", [do, "not", main])
    return "", [freq, c.verb.en_past if past else third_person(main) if third else main]


def _en_rest(c: Clause) -> list[str]:
    return [c.dat.en_obj if c.dat else "", c.acc.en_obj if c.acc else "", c.pred[1] if c.pred else ""] + [
        x[1] if x else "" for x in (c.manner, c.comp, c.place, c.transport)]


def english(c: Clause, form: str = "statement", wh: str = "", front: str = "") -> str:
    """The English of ``german(c, form, wh, front)``; ``front`` is then the English fronted clause."""
    aux, verb_words = _en_verb(c, question=form == "question")
    time = c.time[1] if c.time else ""
    if form == "statement" and c.front_time and not front:
        front, time = time, ""
    lead = [wh, aux, c.subj.en] if form == "question" else [front, c.subj.en]
    return " ".join(w for w in (*lead, *verb_words, *_en_rest(c), time) if w)


def sentence(text: str, end: str) -> str:
    """Capitalised, a/an fixed, with its final punctuation."""
    text = re.sub(r"\b([Aa]) (?=[aeioAEIO]|u(?!ni|se))", r"\1n ", text)
    return text[0].upper() + text[1:] + end


def imperative(c: Clause, address: int, please: bool) -> Pair:
    """Command to du (0), ihr (1) or Sie (2): "Iss bitte den Apfel!" = "Please eat the apple!"."""
    v = c.verb
    assert v is not None and c.tense == "present"
    de_verb = (v.imp, v.pres[4], v.inf[len(v.prefix):] + " Sie")[address]
    de = [de_verb, "bitte" if please else "", *_de_middle(c), v.prefix]
    en = ["please" if please else "", "do not" if c.neg else "", v.en, *_en_rest(c), c.time[1] if c.time else ""]
    return sentence(" ".join(w for w in de if w), "!"), sentence(" ".join(w for w in en if w), "!")
