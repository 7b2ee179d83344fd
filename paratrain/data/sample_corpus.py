"""A small English–French parallel corpus made from a lexicon and a grammar, written as newstest ``.sgm``.

French agreement is real: articles, adjectives, past participles of ``être`` and verbs agree in gender and number with
their noun or subject; ``le/la``, ``de``, ``ne``, ``je`` elide before a vowel (``l'arbre``, ``n'aime``); ``de le`` and
``à le`` contract (``du``, ``au``); pre-nominal and post-nominal adjectives are placed as in French
(``the small black cat`` -> ``le petit chat noir``). Sentences are a pure function of the seed, train and held-out
sentences are disjoint, and the files go through the same ``paratrain.data.wmt14`` path as the real newstest data.
"""
from __future__ import annotations

import html
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from paratrain.data import wmt14


@dataclass(frozen=True)
class Noun:
    en: tuple[str, str]  # singular, plural
    fr: tuple[str, str]
    gender: str  # "m" | "f"
    role: str  # "place" | "animate" | "thing"


@dataclass(frozen=True)
class Adjective:
    en: str
    fr: tuple[str, str, str, str]  # masc sg, fem sg, masc pl, fem pl
    before: bool  # placed before the noun in French


@dataclass(frozen=True)
class Verb:
    en: tuple[str, str, str]  # base, third person singular, past
    fr: tuple[str, ...]  # present: je tu il nous vous ils, then past participle


def _er(stem: str) -> tuple[str, ...]:
    """A regular -er verb: present je tu il nous vous ils, then the past participle."""
    return (stem + "e", stem + "es", stem + "e", stem + "ons", stem + "ez", stem + "ent", stem + "é")


# the word lists; a verb row ends with the stem of a regular -er verb or its seven French forms
LEXICON = json.loads(resources.files(__package__).joinpath("sample_lexicon.json").read_text(encoding="utf-8"))
NOUNS = [Noun((r[0], r[1]), (r[2], r[3]), r[4], r[5]) for r in LEXICON["nouns"]]
PLACES = [n for n in NOUNS if n.role == "place"]
ANIMATE = [n for n in NOUNS if n.role == "animate"]
ADJECTIVES = [Adjective(r[0], tuple(r[1:5]), r[5] == "before") for r in LEXICON["adjectives"]]
VERBS = [Verb(tuple(r[:3]), _er(r[3]) if len(r) == 4 else tuple(r[3:])) for r in LEXICON["verbs"]]
# (English, French, person 0..5 = je tu il nous vous ils, gender)
PRONOUNS = LEXICON["pronouns"]
# determiner: English, French (masc sg, fem sg, plural), number allowed ("sg" | "pl" | "any")
DETERMINERS = LEXICON["determiners"]
DEFINITE = DETERMINERS[:1] + DETERMINERS[2:4]
NUMBERS, PREPOSITIONS, TIME = LEXICON["numbers"], LEXICON["prepositions"], LEXICON["time"]

VOWELS = set("aeiouyhâàéèêîïôœû")
BEFORE_VOWEL = {"ce": "cet", "ma": "mon"}


@dataclass
class Phrase:
    """A noun phrase in both languages with the French agreement features."""

    en: str
    fr: list[str]
    person: int  # 2 (singular) or 5 (plural)
    gender: str


class Grammar:
    """Random sentence pairs from the lexicon, driven by one ``random.Random``."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def noun_phrase(self, nouns: list[Noun] = NOUNS, definite: bool = False) -> Phrase:
        r = self.rng
        noun = r.choice(nouns)
        plural = r.random() < 0.4
        if plural and not definite and r.random() < 0.3:
            en_det, fr_det = r.choice(NUMBERS)
        else:
            allowed = [d for d in (DEFINITE if definite else DETERMINERS)
                       if d[2] == "any" or d[2] == ("pl" if plural else "sg")]
            en_det, forms, _ = r.choice(allowed)
            fr_det = forms[2] if plural else forms[0 if noun.gender == "m" else 1]
        index = (2 if plural else 0) + (1 if noun.gender == "f" else 0)
        pre = r.choice([a for a in ADJECTIVES if a.before]) if r.random() < 0.25 else None
        post = r.choice([a for a in ADJECTIVES if not a.before]) if r.random() < 0.35 else None
        en = [en_det] + [a.en for a in (pre, post) if a] + [noun.en[plural]]
        fr = [fr_det] + ([pre.fr[index]] if pre else []) + [noun.fr[plural]] + ([post.fr[index]] if post else [])
        if fr_det in BEFORE_VOWEL and fr[1][0] in VOWELS:
            fr[0] = BEFORE_VOWEL[fr_det]
        return Phrase(" ".join(en), fr, 5 if plural else 2, noun.gender)

    def subject(self) -> Phrase:
        if self.rng.random() < 0.35:
            en, fr, person, gender = self.rng.choice(PRONOUNS)
            return Phrase(en, [fr], person, gender)
        return self.noun_phrase(ANIMATE)

    def place(self) -> tuple[str, list[str]]:
        en_prep, fr_prep = self.rng.choice(PREPOSITIONS)
        np = self.noun_phrase(PLACES, definite=True)
        return f"{en_prep} {np.en}", fr_prep.split() + np.fr

    def sentence(self) -> tuple[str, str]:
        r = self.rng
        subj = self.subject()
        kind = r.random()
        if kind < 0.2:  # predicative adjective: agreement with the subject
            adj = r.choice(ADJECTIVES)
            past = r.random() < 0.3
            plural = subj.person >= 3
            index = (2 if plural else 0) + (1 if subj.gender == "f" else 0)
            suffix = "_past" if past else ""
            en = [subj.en, LEXICON["be" + suffix][subj.person], adj.en]
            fr = subj.fr + [LEXICON["etre" + suffix][subj.person], adj.fr[index]]
        elif kind < 0.3:  # there is / there are
            np = self.noun_phrase()
            en_prep, fr_place = self.place()
            en = ["there", "are" if np.person == 5 else "is", np.en, en_prep]
            fr = ["il", "y", "a"] + np.fr + fr_place
        else:  # transitive verb, present / past / negated
            verb = r.choice(VERBS)
            obj = self.noun_phrase(definite=r.random() < 0.3)
            tense = r.random()
            third = subj.person == 2
            past = tense < 0.25
            if past:
                en = [subj.en, verb.en[2], obj.en]
                fr = subj.fr + [LEXICON["avoir"][subj.person], verb.fr[6]] + obj.fr
            elif tense < 0.4:
                obj = self.noun_phrase(definite=True)
                en = [subj.en, "does not" if third else "do not", verb.en[0], obj.en]
                fr = subj.fr + ["ne", verb.fr[subj.person], "pas"] + obj.fr
            else:
                en = [subj.en, verb.en[1] if third else verb.en[0], obj.en]
                fr = subj.fr + [verb.fr[subj.person]] + obj.fr
            if r.random() < 0.3:
                en_place, fr_place = self.place()
                en, fr = en + [en_place], fr + fr_place
            if r.random() < 0.15:
                en_time, fr_time = r.choice(TIME["past" if past else "present"])
                en, fr = en + [en_time], fr + [fr_time]
        return _finish(english(en)), _finish(" ".join(french(fr)))


def english(words: list[str]) -> str:
    """Joined words with ``a`` -> ``an`` before a vowel."""
    words = " ".join(words).split()
    return " ".join("an" if w == "a" and nxt[0] in "aeiou" else w for w, nxt in zip(words, words[1:] + ["."]))


CONTRACTIONS = {("de", "le"): "du", ("de", "les"): "des", ("à", "le"): "au", ("à", "les"): "aux"}


def french(words: list[str]) -> list[str]:
    """Elision (``le arbre`` -> ``l'arbre``, ``je aime`` -> ``j'aime``), then contraction (``de le`` -> ``du``)."""
    elided: list[str] = []
    for word in " ".join(words).split():
        if elided and elided[-1] in ("le", "la", "de", "ne", "je") and word[0] in VOWELS:
            elided[-1] = elided[-1][0] + "'" + word
        else:
            elided.append(word)
    out: list[str] = []
    for word in elided:
        if out and (out[-1], word) in CONTRACTIONS:
            out[-1] = CONTRACTIONS[out[-1], word]
        else:
            out.append(word)
    return out


def _finish(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def generate_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` distinct (English, French) pairs; a pure function of ``seed``."""
    grammar = Grammar(random.Random(seed))
    pairs: dict[str, str] = {}
    attempts = 0
    while len(pairs) < count:
        en, fr = grammar.sentence()
        pairs.setdefault(en, fr)
        attempts += 1
        if attempts > 20 * count + 1000:
            raise ValueError(f"the grammar made only {len(pairs)} distinct sentences in {attempts} tries, "
                             f"fewer than {count}")
    return list(pairs.items())


def to_sgm(segments: list[str], set_tag: str, docs: list[str], doc_size: int, lang: str) -> str:
    """Newstest markup: documents of ``doc_size`` segments, entities escaped, blank lines between documents."""
    lines = [f'<{set_tag} setid="paratrain-sample" srclang="any" trglang="{lang}">']
    for d, docid in enumerate(docs):
        lines += [f'<doc sysid="ref" docid="{docid}" genre="news" origlang="en">', "<p>"]
        for i, text in enumerate(segments[d * doc_size : (d + 1) * doc_size], 1):
            lines.append(f'<seg id="{i}">{html.escape(text)}</seg>')
        lines += ["</p>", "</doc>", ""]
    lines.append(f"</{set_tag}>")
    return "\n".join(lines) + "\n"


def write_sample(out_dir: str | Path, train: int = 20000, heldout: int = 500, seed: int = 0,
                 doc_size: int = 50) -> dict[str, dict[str, Path]]:
    """Write ``{split}-fren-src.en.sgm`` / ``{split}-fren-ref.fr.sgm`` for ``train`` and ``test``, then preprocess them.

    Returns ``{split: {"en_fr": pairs file, "fr_en": pairs file}}`` as written by
    ``wmt14.preprocess_files`` under ``out_dir/split``.
    """
    out_dir = Path(out_dir)
    pairs = generate_pairs(train + heldout, seed)
    result = {}
    for split, part in (("train", pairs[:train]), ("test", pairs[train:])):
        docs = [f"sample-{split}-{d:04d}" for d in range((len(part) + doc_size - 1) // doc_size)]
        paths = []
        for side, set_tag, lang in ((0, "srcset", "en"), (1, "refset", "fr")):
            path = out_dir / f"{split}-fren-{'src' if side == 0 else 'ref'}.{lang}.sgm"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(to_sgm([p[side] for p in part], set_tag, docs, doc_size, lang), encoding="utf-8")
            paths.append(path)
        result[split] = wmt14.preprocess_files(*paths, out_dir / split, prefix="sample")
    return result
