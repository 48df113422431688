"""Sentence templates that draw words and build the offline corpus's German→English pairs.

Each template is one construction a learner meets (a plain clause, a question, "weil" with
the verb last, "wenn" with the main clause inverted, a relative clause, ...) and picks its
words so that they fit: the verb's frame names the tags of its objects and places. One
``random.Random(seed)`` drives everything, so a seed always gives the same corpus.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar

from parallel_lib.data import _corpus_grammar as g
from parallel_lib.data import _corpus_lexicon as lex
from parallel_lib.data._corpus_grammar import ACC, DAT, NOM, NP, Clause, Noun, Pair

__all__: list[str] = []

T = TypeVar("T")
PERSONAL = (0, 1, 2, 3, 5, 6, 7)  # pronoun subjects, without "es" (it) for people
DETS, DET_WEIGHTS = ("def", "ein", "poss", "dies", "num"), (45, 30, 12, 5, 8)
SPATIAL = [("auf", "on", "furniture"), ("unter", "under", "furniture"), ("neben", "next to", "furniture landmark"),
           ("hinter", "behind", "landmark furniture"), ("vor", "in front of", "landmark"), ("in", "in", "container")]
NO_IMPERATIVE = {"mögen", "haben", "kennen", "brauchen", "lieben"}
DASS_HEADS = [("sagen", "say"), ("glauben", "think"), ("wissen", "know"), ("hoffen", "hope")]


@dataclass
class Info:
    """What a clause was built from, for the templates that ask about it or refer back to it."""

    subj: Noun | None = None  # None: a pronoun or a name
    acc: Noun | None = None
    where: str = ""  # "Wo" (location) or "Wohin" (direction) when the clause has a place


class Sampler:
    """Random choices for the templates; every one goes through ``self.rng``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, seq: Sequence[T]) -> T:
        return seq[int(self.rng.random() * len(seq))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def other(self, n: Noun, tags: frozenset[str]) -> Noun:
        """A noun with one of ``tags`` other than ``n``: no "Der Stuhl ist unter dem Stuhl."."""
        return self.pick([m for m in g.nouns_with(tags) if m is not n])

    # --- noun phrases ---------------------------------------------------------------------
    def np(self, n: Noun, dets: Sequence[str] = DETS, weights: Sequence[int] = DET_WEIGHTS,
           plural_p: float = 0.25, adj_p: float = 0.25, kein: bool = False) -> NP:
        det = self.rng.choices(dets, weights[: len(dets)])[0]
        word = self.pick(lex.POSSESSIVES) if det == "poss" else self.pick(lex.NUMBERS) if det == "num" else None
        plural = n.pl is not None and (det == "num" or self.chance(plural_p))
        if kein and det == "ein":  # "keinen Apfel", "keine Äpfel", "keinen Kaffee"
            det = "kein"
        adjectives = g.adjectives_for(n)
        adj = self.pick(adjectives) if adjectives and self.chance(adj_p) else None
        return g.noun_phrase(n, det, plural, adj, word)

    def subject(self, tags: frozenset[str], info: Info) -> NP:
        if "person" in tags and self.chance(0.35):
            return g.pronoun(self.pick(PERSONAL)) if self.chance(0.7) else g.name(*self.pick(lex.NAMES))
        info.subj = self.pick(g.nouns_with(tags))
        if tags & {"person", "animal", "flyer", "swimmer"}:
            return self.np(info.subj, adj_p=0.2)
        return self.np(info.subj, dets=("def", "dies", "poss"), weights=(70, 15, 15), plural_p=0.1, adj_p=0.2)

    # --- adverbials -----------------------------------------------------------------------
    def time(self, tense: str) -> Pair:
        if self.chance(0.2):
            day, day_en = self.pick(lex.DAYS)
            return f"am {day}", f"on {day_en}"
        if tense == "past":
            if self.chance(0.15):
                number, number_en = self.pick(lex.NUMBERS)
                return f"vor {number} Tagen", f"{number_en} days ago"
            return self.pick(lex.TIMES_PAST)
        if tense == "present" and self.chance(0.15):  # "um ein Uhr", not "um eins Uhr"
            hour, hour_en = self.pick([("ein", "one")] + lex.NUMBERS)
            return f"um {hour} Uhr", f"at {hour_en} o'clock"
        return self.pick(lex.TIMES_PRESENT if tense == "present" else lex.TIMES_FUTURE)

    def place(self, tags: frozenset[str]) -> Pair:
        """Where: "im Garten" = "in the garden", "in Berlin", "zu Hause" = "at home"."""
        if tags & {"live", "arrive"} and self.chance(0.3):
            city, city_en = self.pick(lex.CITIES)
            return f"in {city}", f"in {city_en}"
        if tags & {"live", "eat", "arrive"} and self.chance(0.1):
            return "zu Hause", "at home"
        n = self.pick(g.nouns_with(tags))
        np = self.np(n, dets=("def", "poss", "dies"), weights=(75, 20, 5), plural_p=0.0, adj_p=0.15)
        prep, prep_en = ("in", "in") if "water" in tags & n.tags else n.loc  # swim "im See", sit "am See"
        return g.prep_phrase(prep, np), f"{prep_en} {np.en_obj}"

    def direction(self, cities_only: bool) -> Pair:
        """Where to: "nach Berlin", "in den Park" (accusative), "zum Bahnhof", "nach Hause" = "home"."""
        if cities_only or self.chance(0.3):
            city, city_en = self.pick(lex.CITIES)
            return f"nach {city}", f"to {city_en}"
        if self.chance(0.1):
            return "nach Hause", "home"
        n = self.pick(g.nouns_with(frozenset({"dest"})))
        np = self.np(n, dets=("def", "poss"), weights=(85, 15), plural_p=0.0, adj_p=0.15)
        return g.prep_phrase(n.dir, np, DAT if n.dir == "zu" else ACC), f"to {np.en_obj}"

    def companion(self, subj: NP) -> Pair | None:
        np = self.np(self.pick(g.nouns_with(frozenset({"person", "pet"}))), dets=("def", "poss", "ein"),
                     weights=(40, 50, 10), adj_p=0.1)
        return None if np.en == subj.en else (f"mit {np.de[DAT]}", f"with {np.en_obj}")

    def transport(self, on_foot: bool) -> Pair:
        if on_foot and self.chance(0.15):
            return "zu Fuß", "on foot"
        n = self.pick(g.nouns_with(frozenset({"transport"})))
        return g.prep_phrase("mit", g.noun_phrase(n)), f"by {n.en_sg}"  # "mit dem Zug" = "by train"

    # --- clauses --------------------------------------------------------------------------
    def tense(self) -> str:
        r = self.rng.random()
        return "present" if r < 0.5 else "past" if r < 0.75 else self.pick(tuple(lex.MODALS))

    def clause(self, v: g.Verb, tense: str | None = None, neg: bool | None = None, lean: bool = False
               ) -> tuple[Clause, Info]:
        """A clause around verb ``v`` with words its frame allows; lean: fewer adverbials."""
        f, extra, info = v.frame, 0.5 if lean else 1.0, Info()
        tense = tense or self.tense()
        neg = self.chance(0.2) if neg is None else neg
        subj = self.subject(v.subj, info)
        acc = dat = place = comp = transport = manner = time = freq = None
        if "acc" in f:
            info.acc = self.pick(g.nouns_with(f["acc"]))
            acc = self.np(info.acc, dets=DETS[:4] if neg else DETS, kein=neg)  # no "nicht zwei Äpfel"
        if "dat" in f:
            dat = self.np(self.pick(g.nouns_with(f["dat"])), dets=("def", "poss", "ein"), weights=(55, 35, 10),
                          plural_p=0.15, adj_p=0.1)
        if "place!" in f or ("place" in f and self.chance(0.3 * extra)):
            place, info.where = self.place(f.get("place!") or f["place"]), "Wo"
        elif "dir" in f and self.chance(0.7):
            place, info.where = self.direction(cities_only="city" in f["dir"]), "Wohin"
        if "transport" in f and self.chance(0.3 * extra):
            transport = self.transport(on_foot=v.inf == "kommen")
        if "with" in f and self.chance(0.15 * extra):
            comp = self.companion(subj)
        if "manner" in f and self.chance(0.12 * extra):
            manner = self.pick(lex.MANNER)
        if self.chance(0.3 * extra):
            time = self.time(tense)
        if not neg and tense in ("present", "past") and self.chance(0.1):
            freq = self.pick(lex.FREQUENCY)
        gern = not neg and not freq and tense == "present" and self.chance(0.05)
        return Clause(subj, v, tense, acc, dat, None, neg, time, freq, gern, manner, comp, transport, place,
                      front_time=bool(time) and self.chance(0.4)), info

    def copula(self) -> tuple[Clause, str]:
        """ "Der Hund ist (nicht) müde." (kind "adj") or "Der Schlüssel ist auf dem Tisch." (kind "place")."""
        n = self.pick(g.NOUNS)
        subj = (g.pronoun(self.pick(PERSONAL)) if "person" in n.tags and self.chance(0.3) else
                self.np(n, dets=("def", "poss", "dies", "num"), weights=(60, 25, 10, 5), adj_p=0.1))
        adjectives = [a for a in g.adjectives_for(n) if a.en not in subj.en.split()]
        if n.tags & {"object", "plant"} and self.chance(0.3):
            prep, prep_en, grounds = self.pick(SPATIAL)
            ground = self.np(self.other(n, frozenset(grounds.split())), dets=("def", "poss"), weights=(80, 20),
                             plural_p=0, adj_p=0)
            pred, kind = (g.prep_phrase(prep, ground), f"{prep_en} {ground.en_obj}"), "place"
        elif n.tags & {"person", "animal"} and self.chance(0.2) or not adjectives:
            pred, kind = self.place(frozenset({"outdoor", "room", "work", "eat"})), "place"
        else:
            adj = self.pick(adjectives)
            pred, kind = (adj.pred, adj.en), "adj"
        neg = self.chance(0.2)
        freq = self.pick(lex.FREQUENCY[:4]) if not neg and self.chance(0.08) else None
        return Clause(subj, None, "past" if self.chance(0.3) else "present", pred=pred, neg=neg, freq=freq), kind

    def reason(self, who: Pair, person: int, group: str | None, past: bool, human: bool = True) -> Pair:
        """A verb-last clause saying why: "er müde ist" = "he is tired", "sie Hunger hat", "es regnet"."""
        if group is None and (not human or self.chance(0.5)):  # things have no time, only weather
            weather = self.pick(lex.WEATHER)
            return (weather[3], weather[4]) if past else (weather[0], weather[1])
        if group is None:
            kind, word, word_en = ("have", "keine Zeit", "no time") if self.chance(0.3) else ("have", "Zeit", "time")
        else:
            kind, word, word_en = self.pick(lex.REASONS[group])
        tables = lex.PAST if past else lex.PRESENT
        verb_de = tables["sein" if kind == "adj" else "haben"][person]
        verb_en = g.EN_BE[past][person] if kind != "have" else "had" if past else "has" if person == 2 else "have"
        return f"{who[0]} {word} {verb_de}", f"{who[1]} {verb_en} {word_en}"


def _pair(c: Clause, form: str = "statement", end: str = ".", wh: Pair = ("", ""), front: Pair = ("", "")) -> Pair:
    return (g.sentence(g.german(c, form, wh[0], front[0]), end),
            g.sentence(g.english(c, form, wh[1], front[1]), end))


def _plain(s: Sampler) -> Pair:
    """A clause as a statement (62%), a yes/no question (16%) or a wh-question (22%)."""
    v, r = s.pick(g.VERBS), s.rng.random()
    c, info = s.clause(v, neg=None if r < 0.62 else False)  # questions are never negated
    if r < 0.62:
        return _pair(c)
    c = replace(c, front_time=False)
    if r < 0.78:
        return _pair(c, "question", "?")
    roles = ["subj", "why", "when"] + ["acc"] * bool(c.acc) + ["dat"] * bool(c.dat and not c.acc)
    roles += ["where"] * bool(info.where) + ["how_many"] * bool(c.acc and c.acc.person == 5 and info.acc.pl)
    role = s.pick(roles)
    if role == "subj":  # "Wer isst den Apfel?": a statement with "wer" as its subject
        return _pair(replace(c, subj=g.WHO if v.subj & {"person", "animal"} else g.WHAT), end="?")
    if role == "acc":
        wh, c = (("Wen", "who") if c.acc.human else ("Was", "what")), replace(c, acc=None)  # type: ignore
    elif role == "how_many":
        wh, c = (f"Wie viele {info.acc.pl}", f"how many {info.acc.en_pl}"), replace(c, acc=None)  # type: ignore
    elif role == "dat":
        wh, c = ("Wem", "who"), replace(c, dat=None)
    elif role == "where":
        wh, c = (info.where, "where"), replace(c, place=None)
    elif role == "when":
        wh, c = ("Wann", "when"), replace(c, time=None)
    else:
        wh = ("Warum", "why")
    return _pair(c, "question", "?", wh)


def _be(s: Sampler) -> Pair:
    """ "Der Hund ist müde." / "Ist der Schlüssel auf dem Tisch?" / "Wo ist ...?" / "Wer ist ...?" """
    (c, kind), r = s.copula(), s.rng.random()
    if r < 0.7:
        return _pair(c)
    c = replace(c, neg=False)
    if kind == "place" and r > 0.85:
        return _pair(replace(c, pred=None, freq=None), "question", "?", ("Wo", "where"))
    if c.subj.human and r > 0.85:  # "Wer ist müde?" = "Who is tired?"
        return _pair(replace(c, subj=g.WHO), end="?")
    return _pair(c, "question", "?")


def _compare(s: Sampler) -> Pair:
    """ "Der Hund ist größer als die Katze." / "... so groß wie ..." = "... as big as ..." """
    adj = s.pick([a for a in g.ADJECTIVES if a.comp])
    # compare like with like: two animals, two places
    category = frozenset({s.pick([t for t in sorted(adj.tags) if len(g.nouns_with(frozenset({t}))) > 1])})
    first = s.pick(g.nouns_with(category))
    second = s.other(first, category)
    plural = float(s.chance(0.2))
    a, b = (s.np(n, dets=("def", "poss", "dies"), weights=(75, 20, 5), plural_p=plural, adj_p=0)
            for n in (first, second))
    if s.chance(0.75):
        pred = f"{adj.comp} als {b.de[NOM]}", f"{adj.en_comp} than {b.en}"
    else:
        pred = f"so {adj.pred} wie {b.de[NOM]}", f"as {adj.en} as {b.en}"
    return _pair(Clause(a, None, "past" if s.chance(0.25) else "present", pred=pred, neg=s.chance(0.15)))


def _there_is(s: Sampler) -> Pair:
    """ "Im Park gibt es einen Hund." = "There is a dog in the park." (kein: "There is no dog ...")"""
    where = s.pick(g.nouns_with(frozenset({"outdoor", "room", "live", "eat"})))
    place_np = s.np(where, dets=("def", "poss"), weights=(85, 15), plural_p=0, adj_p=0.1)
    place = g.prep_phrase(where.loc[0], place_np), f"{where.loc[1]} {place_np.en_obj}"
    things = {"object"} if "room" in where.tags else {"person"} if "eat" in where.tags else {"person", "animal", "plant"}
    neg, past, question = s.chance(0.15), s.chance(0.25), s.chance(0.15)
    thing = s.np(s.pick(g.nouns_with(frozenset(things))), dets=("ein", "num"), weights=(70, 30), plural_p=0.15,
                 kein=neg and not question)
    en_thing = "no " + re.sub(r"^a ", "", thing.en) if thing.kein else thing.en
    gibt = "gab" if past else "gibt"
    be = ("were" if past else "are") if thing.person == 5 else ("was" if past else "is")
    if question:
        return g.sentence(f"{gibt} es {thing.de[ACC]} {place[0]}", "?"), g.sentence(f"{be} there {en_thing} {place[1]}", "?")
    de = f"{place[0]} {gibt} es {thing.de[ACC]}" if s.chance(0.5) else f"es {gibt} {thing.de[ACC]} {place[0]}"
    return g.sentence(de, "."), g.sentence(f"there {be} {en_thing} {place[1]}", ".")


def _that(s: Sampler) -> Pair:
    """ "Anna sagt, dass der Mann den Apfel isst." (verb last) = "Anna says that the man eats the apple." """
    head_verb, head_en = s.pick(DASS_HEADS)
    head = s.subject(frozenset({"person"}), Info())
    finite = g.present(head_verb)[head.person]
    c, _ = s.clause(s.pick(g.VERBS), lean=True)
    c = replace(c, front_time=False)
    head_en = g.third_person(head_en) if head.person == 2 else head_en
    return (g.sentence(f"{head.de[NOM]} {finite}, dass {g.german(c, 'sub')}", "."),
            g.sentence(f"{head.en} {head_en} that {g.english(c)}", "."))


def _because(s: Sampler) -> Pair:
    """ "Das Kind schläft, weil es müde ist." = "The child sleeps because it is tired." """
    v = s.pick(g.VERBS)
    c, _ = s.clause(v, lean=True)
    group = lex.REASONS_OF_VERB.get(v.inf)
    why = s.reason(c.subj.pron, c.subj.person, group, c.tense == "past", human=c.subj.human)
    if c.subj.key in ("ich", "du", "wir", "ihr") and s.chance(0.3):  # reason first: main clause verb first
        return _pair(replace(c, front_time=False), front=(f"weil {why[0]},", f"because {why[1]},"))
    return g.sentence(f"{g.german(c)}, weil {why[0]}", "."), g.sentence(f"{g.english(c)} because {why[1]}", ".")


def _when(s: Sampler) -> Pair:
    """ "Wenn es regnet, bleibt der Mann zu Hause." (main clause verb first) = "When it rains, ..." """
    if s.chance(0.5):
        weather = s.pick(lex.WEATHER)
        c, _ = s.clause(s.pick(g.VERBS), tense="present", lean=True)
        cond = weather[0], weather[2]
    else:  # "Wenn der Mann müde ist, schläft er." = "When the man is tired, he sleeps."
        v = s.pick([v for v in g.VERBS if v.inf in lex.REASONS_OF_VERB])
        c, _ = s.clause(v, tense="present", lean=True)
        cond = s.reason((c.subj.de[NOM], c.subj.en), c.subj.person, lex.REASONS_OF_VERB[v.inf], past=False)
        if c.subj.key in ("m", "f", "n", "pl"):  # a noun or name goes into the condition, its pronoun here
            c = replace(c, subj=replace(c.subj, de=(c.subj.pron[0],) * 3, en=c.subj.pron[1]))
    return _pair(replace(c, front_time=False), front=(f"wenn {cond[0]},", f"when {cond[1]},"))


def _relative(s: Sampler) -> Pair:
    """ "Der Mann, der im Garten arbeitet, ist müde." / "Das Buch, das die Frau liest, ist neu." """
    if s.chance(0.5):  # the head noun is the relative clause's subject: "der" = "who"/"that"
        v = s.pick([v for v in g.VERBS if v.subj & {"person", "animal"}])
        c, info = s.clause(v, tense=s.pick(("present", "past")), neg=False, lean=True)
        head_noun = info.subj or s.pick(g.nouns_with(frozenset({"person"})))
        head = s.np(head_noun, dets=("def", "dies", "poss"), weights=(70, 15, 15), adj_p=0.1)
        rel = replace(head, de=(g.DEF[head.key][NOM],) * 3, en="who" if head.human else "that")
        inner = replace(c, subj=rel, front_time=False)
        rel_de, rel_en = g.german(inner, "sub"), g.english(inner)
    else:  # the head noun is its accusative object: "den"/"die"/"das" = "that"
        v = s.pick([v for v in g.VERBS if "acc" in v.frame])
        c, info = s.clause(v, tense=s.pick(("present", "past")), neg=False, lean=True)
        head_noun = info.acc  # type: ignore[assignment]
        head = s.np(head_noun, dets=("def", "dies", "poss"), weights=(70, 15, 15), adj_p=0.1)
        inner = replace(c, acc=None, front_time=False)
        rel_de, rel_en = f"{g.DEF[head.key][ACC]} {g.german(inner, 'sub')}", f"that {g.english(inner)}"
    subj = replace(head, de=(f"{head.de[NOM]}, {rel_de},",) * 3, en=f"{head.en} {rel_en}")
    adjectives = [(a.pred, a.en) for a in g.adjectives_for(head_noun) if a.en not in head.en.split()]
    pred = s.pick(adjectives) if adjectives else ("hier", "here")  # "Das Geld, das ..., ist hier."
    return _pair(Clause(subj, None, s.pick(("present", "past")), pred=pred, neg=s.chance(0.15)))


def _command(s: Sampler) -> Pair:
    """ "Iss bitte den Apfel!" / "Esst ..." / "Essen Sie ..." = "Please eat the apple!" """
    v = s.pick([v for v in g.VERBS if "person" in v.subj and v.inf not in NO_IMPERATIVE])
    c, _ = s.clause(v, tense="present", lean=True)
    c = replace(c, freq=None, gern=False, front_time=False)
    return g.imperative(c, s.rng.choices((0, 1, 2), (60, 20, 20))[0], please=s.chance(0.3))


TEMPLATES: list[tuple[Callable[[Sampler], Pair], int]] = [
    (_plain, 40), (_be, 12), (_compare, 4), (_there_is, 5), (_that, 8), (_because, 9), (_when, 5),
    (_relative, 7), (_command, 6)]


def generate_pairs(n: int, seed: int) -> list[Pair]:
    """``n`` distinct (German, English) pairs, in the order drawn; the same for the same seed.

    Distinct means distinct German: one German sentence never has two translations.
    """
    sampler, seen, pairs = Sampler(seed), set(), []
    templates = [t for t, _ in TEMPLATES]
    cumulative = list(itertools.accumulate(w for _, w in TEMPLATES))
    for _ in range(20 * n):
        template = templates[bisect.bisect(cumulative, sampler.rng.random() * cumulative[-1])]
        de, en = template(sampler)
        if de not in seen:
            seen.add(de)
            pairs.append((de, en))
            if len(pairs) == n:
                return pairs
    raise RuntimeError(f"the corpus grammar gave only {len(pairs)} distinct sentences, fewer than n={n}")
