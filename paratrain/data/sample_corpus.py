"""A small English–French parallel corpus made from a lexicon and a grammar, written as newstest ``.sgm``.

French agreement is real: articles, adjectives, past participles of ``être``
and verbs agree in gender and number with their noun or subject; ``le/la``,
``de``, ``ne``, ``je`` elide before a vowel (``l'arbre``, ``n'aime``); ``de le``
and ``à le`` contract (``du``, ``au``); pre-nominal and post-nominal adjectives
are placed as in French (``the small black cat`` -> ``le petit chat noir``).
Sentences are a pure function of the seed, train and held-out sentences are
disjoint, and the files go through the same ``paratrain.data.wmt14`` path as
the real newstest data.
"""
from __future__ import annotations

import html
import random
from dataclasses import dataclass
from pathlib import Path

from paratrain.data import wmt14


@dataclass(frozen=True)
class Noun:
    en: tuple[str, str]  # singular, plural
    fr: tuple[str, str]
    gender: str  # "m" | "f"


@dataclass(frozen=True)
class Adjective:
    en: str
    fr: tuple[str, str, str, str]  # masc sg, fem sg, masc pl, fem pl
    before: bool  # placed before the noun in French


@dataclass(frozen=True)
class Verb:
    en: tuple[str, str, str]  # base, third person singular, past
    fr: tuple[str, ...]  # present: je tu il nous vous ils, then past participle


def _nouns(table: str) -> list[Noun]:
    out = []
    for line in table.strip().splitlines():
        en, fr, gender = line.split()
        (en_sg, en_pl), (fr_sg, fr_pl) = en.split("/"), fr.split("/")
        out.append(Noun((en_sg, en_pl), (fr_sg, fr_pl), gender))
    return out


NOUNS = _nouns("""
cat/cats chat/chats m
dog/dogs chien/chiens m
bird/birds oiseau/oiseaux m
horse/horses cheval/chevaux m
animal/animals animal/animaux m
mouse/mice souris/souris f
cow/cows vache/vaches f
duck/ducks canard/canards m
fish/fish poisson/poissons m
rabbit/rabbits lapin/lapins m
man/men homme/hommes m
woman/women femme/femmes f
boy/boys garçon/garçons m
girl/girls fille/filles f
child/children enfant/enfants m
friend/friends ami/amis m
teacher/teachers professeur/professeurs m
student/students étudiante/étudiantes f
doctor/doctors médecin/médecins m
farmer/farmers fermier/fermiers m
neighbour/neighbours voisine/voisines f
king/kings roi/rois m
queen/queens reine/reines f
house/houses maison/maisons f
car/cars voiture/voitures f
book/books livre/livres m
table/tables table/tables f
chair/chairs chaise/chaises f
door/doors porte/portes f
window/windows fenêtre/fenêtres f
tree/trees arbre/arbres m
flower/flowers fleur/fleurs f
apple/apples pomme/pommes f
cake/cakes gâteau/gâteaux m
letter/letters lettre/lettres f
bottle/bottles bouteille/bouteilles f
key/keys clé/clés f
box/boxes boîte/boîtes f
bag/bags sac/sacs m
hat/hats chapeau/chapeaux m
shirt/shirts chemise/chemises f
shoe/shoes chaussure/chaussures f
boat/boats bateau/bateaux m
plane/planes avion/avions m
train/trains train/trains m
bicycle/bicycles vélo/vélos m
garden/gardens jardin/jardins m
school/schools école/écoles f
church/churches église/églises f
hotel/hotels hôtel/hôtels m
island/islands île/îles f
river/rivers rivière/rivières f
road/roads route/routes f
city/cities ville/villes f
village/villages village/villages m
forest/forests forêt/forêts f
mountain/mountains montagne/montagnes f
kitchen/kitchens cuisine/cuisines f
room/rooms chambre/chambres f
picture/pictures image/images f
song/songs chanson/chansons f
newspaper/newspapers journal/journaux m
computer/computers ordinateur/ordinateurs m
phone/phones téléphone/téléphones m
glass/glasses verre/verres m
plate/plates assiette/assiettes f
cup/cups tasse/tasses f
egg/eggs œuf/œufs m
ball/balls balle/balles f
pen/pens stylo/stylos m
""")

PLACES = [n for n in NOUNS if n.en[0] in {
    "house", "car", "table", "chair", "door", "window", "tree", "box", "bag", "boat", "plane", "train",
    "garden", "school", "church", "hotel", "island", "river", "road", "city", "village", "forest",
    "mountain", "kitchen", "room"}]
ANIMATE = [n for n in NOUNS if n.en[0] in {
    "cat", "dog", "bird", "horse", "animal", "mouse", "cow", "duck", "fish", "rabbit", "man", "woman", "boy",
    "girl", "child", "friend", "teacher", "student", "doctor", "farmer", "neighbour", "king", "queen"}]


def _adjectives(table: str, before: bool) -> list[Adjective]:
    rows = (line.split(maxsplit=1) for line in table.strip().splitlines())
    return [Adjective(en, tuple(fr.split()), before) for en, fr in rows]


ADJECTIVES = _adjectives("""
small petit petite petits petites
big grand grande grands grandes
young jeune jeune jeunes jeunes
good bon bonne bons bonnes
bad mauvais mauvaise mauvais mauvaises
pretty joli jolie jolis jolies
fat gros grosse gros grosses
""", before=True) + _adjectives("""
black noir noire noirs noires
white blanc blanche blancs blanches
green vert verte verts vertes
blue bleu bleue bleus bleues
red rouge rouge rouges rouges
yellow jaune jaune jaunes jaunes
grey gris grise gris grises
brown brun brune bruns brunes
french français française français françaises
english anglais anglaise anglais anglaises
italian italien italienne italiens italiennes
fast rapide rapide rapides rapides
slow lent lente lents lentes
happy heureux heureuse heureux heureuses
sad triste triste tristes tristes
quiet calme calme calmes calmes
strong fort forte forts fortes
warm chaud chaude chauds chaudes
cold froid froide froids froides
clean propre propre propres propres
dirty sale sale sales sales
old ancien ancienne anciens anciennes
tired fatigué fatiguée fatigués fatiguées
famous célèbre célèbre célèbres célèbres
empty vide vide vides vides
full plein pleine pleins pleines
round rond ronde ronds rondes
heavy lourd lourde lourds lourdes
expensive cher chère chers chères
""", before=False)


def _er(stem: str) -> tuple[str, ...]:
    """A regular -er verb: present je tu il nous vous ils, then the past participle."""
    return (stem + "e", stem + "es", stem + "e", stem + "ons", stem + "ez", stem + "ent", stem + "é")


VERBS = [
    Verb(("watch", "watches", "watched"), _er("regard")),
    Verb(("look for", "looks for", "looked for"), _er("cherch")),
    Verb(("find", "finds", "found"), _er("trouv")),
    Verb(("carry", "carries", "carried"), _er("port")),
    Verb(("love", "loves", "loved"), _er("aim")),
    Verb(("wash", "washes", "washed"), _er("lav")),
    Verb(("keep", "keeps", "kept"), _er("gard")),
    Verb(("prepare", "prepares", "prepared"), _er("prépar")),
    Verb(("leave", "leaves", "left"), _er("quitt")),
    Verb(("visit", "visits", "visited"), _er("visit")),
    Verb(("listen to", "listens to", "listened to"), _er("écout")),
    Verb(("draw", "draws", "drew"), _er("dessin")),
    Verb(("hide", "hides", "hid"), _er("cach")),
    Verb(("show", "shows", "showed"), _er("montr")),
    Verb(("bring", "brings", "brought"), _er("apport")),
    Verb(("forget", "forgets", "forgot"), _er("oubli")),
    Verb(("catch", "catches", "caught"), _er("attrap")),
    Verb(("touch", "touches", "touched"), _er("touch")),
    Verb(("push", "pushes", "pushed"), _er("pouss")),
    Verb(("pull", "pulls", "pulled"), _er("tir")),
    Verb(("repair", "repairs", "repaired"), _er("répar")),
    Verb(("use", "uses", "used"), _er("utilis")),
    Verb(("steal", "steals", "stole"), _er("vol")),
    Verb(("follow", "follows", "followed"), ("suis", "suis", "suit", "suivons", "suivez", "suivent", "suivi")),
    Verb(("see", "sees", "saw"), ("vois", "vois", "voit", "voyons", "voyez", "voient", "vu")),
    Verb(("take", "takes", "took"), ("prends", "prends", "prend", "prenons", "prenez", "prennent", "pris")),
    Verb(("want", "wants", "wanted"), ("veux", "veux", "veut", "voulons", "voulez", "veulent", "voulu")),
    Verb(("sell", "sells", "sold"), ("vends", "vends", "vend", "vendons", "vendez", "vendent", "vendu")),
    Verb(("open", "opens", "opened"), ("ouvre", "ouvres", "ouvre", "ouvrons", "ouvrez", "ouvrent", "ouvert")),
    Verb(("paint", "paints", "painted"), ("peins", "peins", "peint", "peignons", "peignez", "peignent", "peint")),
]

# (English, French, person 0..5 = je tu il nous vous ils, gender)
PRONOUNS = [("I", "je", 0, "m"), ("you", "tu", 1, "m"), ("he", "il", 2, "m"), ("she", "elle", 2, "f"),
            ("we", "nous", 3, "m"), ("they", "ils", 5, "m")]
AVOIR = ("ai", "as", "a", "avons", "avez", "ont")
ETRE = ("suis", "es", "est", "sommes", "êtes", "sont")
EN_BE = ("am", "are", "is", "are", "are", "are")
EN_BE_PAST = ("was", "were", "was", "were", "were", "were")
# determiner: English, French (masc sg, fem sg, plural), number allowed ("sg" | "pl" | "any")
DETERMINERS = [("the", ("le", "la", "les"), "any"), ("a", ("un", "une", None), "sg"),
               ("this", ("ce", "cette", None), "sg"), ("these", (None, None, "ces"), "pl"),
               ("my", ("mon", "ma", "mes"), "any"), ("our", ("notre", "notre", "nos"), "any"),
               ("your", ("votre", "votre", "vos"), "any"), ("some", (None, None, "des"), "pl")]
DEFINITE = DETERMINERS[:1] + DETERMINERS[2:4]
NUMBERS = [("two", "deux"), ("three", "trois"), ("four", "quatre"), ("five", "cinq"), ("six", "six"),
           ("seven", "sept"), ("eight", "huit"), ("nine", "neuf"), ("ten", "dix")]
PREPOSITIONS = [("in", "dans"), ("on", "sur"), ("under", "sous"), ("near", "près de"), ("behind", "derrière"),
                ("in front of", "devant"), ("next to", "à côté de"), ("far from", "loin de")]
TIME = {"present": [("today", "aujourd'hui"), ("every morning", "chaque matin"), ("in the evening", "le soir"),
                    ("often", "souvent"), ("again", "encore")],
        "past": [("today", "aujourd'hui"), ("yesterday", "hier"), ("again", "encore")]}

VOWELS = set("aeiouyhâàéèêîïôœû")


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

    def choice(self, items):
        return items[self.rng.randrange(len(items))]

    def noun_phrase(self, nouns: list[Noun] = NOUNS, definite: bool = False) -> Phrase:
        r = self.rng
        noun = self.choice(nouns)
        plural = r.random() < 0.4
        number = None
        if plural and not definite and r.random() < 0.3:
            number = self.choice(NUMBERS)
            en_det, fr_det = number
        else:
            allowed = [d for d in (DEFINITE if definite else DETERMINERS)
                       if d[2] == "any" or d[2] == ("pl" if plural else "sg")]
            en_det, forms, _ = self.choice(allowed)
            fr_det = forms[2] if plural else forms[0 if noun.gender == "m" else 1]
        index = (2 if plural else 0) + (1 if noun.gender == "f" else 0)
        pre = self.choice([a for a in ADJECTIVES if a.before]) if r.random() < 0.25 else None
        post = self.choice([a for a in ADJECTIVES if not a.before]) if r.random() < 0.35 else None
        en = [en_det] + [a.en for a in (pre, post) if a] + [noun.en[plural]]
        fr = [fr_det] + ([pre.fr[index]] if pre else []) + [noun.fr[plural]] + ([post.fr[index]] if post else [])
        if fr_det == "ce" and fr[1][0] in VOWELS:
            fr[0] = "cet"
        if fr_det == "ma" and fr[1][0] in VOWELS:
            fr[0] = "mon"
        return Phrase(" ".join(en), fr, 5 if plural else 2, noun.gender)

    def subject(self) -> Phrase:
        if self.rng.random() < 0.35:
            en, fr, person, gender = self.choice(PRONOUNS)
            return Phrase(en, [fr], person, gender)
        return self.noun_phrase(ANIMATE)

    def place(self) -> tuple[str, list[str]]:
        en_prep, fr_prep = self.choice(PREPOSITIONS)
        np = self.noun_phrase(PLACES, definite=True)
        return f"{en_prep} {np.en}", fr_prep.split() + np.fr

    def sentence(self) -> tuple[str, str]:
        r = self.rng
        subj = self.subject()
        kind = r.random()
        if kind < 0.2:  # predicative adjective: agreement with the subject
            adj = self.choice(ADJECTIVES)
            past = r.random() < 0.3
            plural = subj.person >= 3
            index = (2 if plural else 0) + (1 if subj.gender == "f" else 0)
            be = (EN_BE_PAST if past else EN_BE)[subj.person]
            etre = ("étais", "étais", "était", "étions", "étiez", "étaient") if past else ETRE
            en = [subj.en, be, adj.en]
            fr = subj.fr + [etre[subj.person], adj.fr[index]]
        elif kind < 0.3:  # there is / there are
            np = self.noun_phrase()
            en_prep, fr_place = self.place()
            en = ["there", "are" if np.person == 5 else "is", np.en, en_prep]
            fr = ["il", "y", "a"] + np.fr + fr_place
        else:  # transitive verb, present / past / negated
            verb = self.choice(VERBS)
            obj = self.noun_phrase(definite=r.random() < 0.3)
            tense = r.random()
            third = subj.person == 2
            past = tense < 0.25
            if past:
                en = [subj.en, verb.en[2], obj.en]
                fr = subj.fr + [AVOIR[subj.person], verb.fr[6]] + obj.fr
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
                en_time, fr_time = self.choice(TIME["past" if past else "present"])
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
