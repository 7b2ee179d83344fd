"""newstest .sgm parsing and pairing, archive reading, the generated sample corpus."""
import tarfile

import pytest

from paratrain.cli import main
from paratrain.data import wmt14
from paratrain.data.sample_corpus import french, generate_pairs, write_sample

SRC = """<srcset setid="newstest2014" srclang="any">
<doc sysid="ref" docid="1012-bbc" genre="news" origlang="en">
<p>
<seg id="1">Tom &amp; Jerry say &quot;hi&quot; &lt;now&gt;</seg>
<seg id="2">  Caf&eacute; &#233;t&#xE9; — déjà vu  </seg>
</p>

<p>
<seg id=3>It&#39;s	a tab</seg>
</p>
</doc>

<doc docid='2' sysid="ref">
<seg id="1">Second document</seg>
</doc>
</srcset>
"""

REF = """<refset setid="newstest2014" srclang="any" trglang="fr">
<doc sysid="ref" docid="1012-bbc" genre="news" origlang="en">
<p>
<seg id="2">Café été — déjà vu</seg>
<seg id="1">Tom &amp; Jerry disent « salut »</seg>
<seg id="3">C&apos;est une tabulation</seg>
</p>
</doc>
<doc sysid="ref" docid="2">

<seg id="1">Deuxième document</seg>
</doc>
</refset>
"""

EXPECTED = [("Tom & Jerry say \"hi\" <now>", "Tom & Jerry disent « salut »"),
            ("Café été — déjà vu", "Café été — déjà vu"),
            ("It's a tab", "C'est une tabulation"),
            ("Second document", "Deuxième document")]


def test_entities_documents_blank_lines_and_pairing():
    docs = wmt14.parse_sgm(SRC)
    assert list(docs) == ["1012-bbc", "2"]
    assert list(docs["1012-bbc"]) == ["1", "2", "3"]
    assert wmt14.pair_documents(docs, wmt14.parse_sgm(REF)) == EXPECTED


def test_files_written_both_directions(tmp_path):
    (tmp_path / "newstest2014-fren-src.en.sgm").write_text(SRC, encoding="utf-8")
    (tmp_path / "newstest2014-fren-ref.fr.sgm").write_text(REF, encoding="utf-8")
    assert main(["preprocess", "wmt14", "--src", str(tmp_path / "newstest2014-fren-src.en.sgm"),
                 "--ref", str(tmp_path / "newstest2014-fren-ref.fr.sgm"), "--out", str(tmp_path / "out")]) == 0
    assert wmt14.read_pairs(tmp_path / "out" / "wmt14.en_fr.txt") == EXPECTED
    assert wmt14.read_pairs(tmp_path / "out" / "wmt14.fr_en.txt") == [(b, a) for a, b in EXPECTED]


def test_archive(tmp_path):
    for name, text in (("newstest2014-fren-src.en.sgm", SRC), ("newstest2014-fren-ref.fr.sgm", REF),
                       ("newstest2014-deen-src.en.sgm", "unrelated")):
        (tmp_path / "test-full").mkdir(exist_ok=True)
        (tmp_path / "test-full" / name).write_text(text, encoding="utf-8")
    with tarfile.open(tmp_path / "test-full.tgz", "w:gz") as tar:
        tar.add(tmp_path / "test-full", arcname="test-full")
    written = wmt14.preprocess_archive(tmp_path / "test-full.tgz", tmp_path / "out")
    assert wmt14.read_pairs(written["en_fr"]) == EXPECTED
    with pytest.raises(wmt14.SgmError, match="newstest2014-csen-src.en.sgm"):
        wmt14.preprocess_archive(tmp_path / "test-full.tgz", tmp_path / "out", tgt_lang="cs")


def test_missing_segment_names_document_and_segment():
    ref = REF.replace('<seg id="3">C&apos;est une tabulation</seg>\n', "")
    with pytest.raises(wmt14.SgmError, match=r"document '1012-bbc': segment 3 is in source but not in reference"):
        wmt14.pair_documents(wmt14.parse_sgm(SRC), wmt14.parse_sgm(ref))
    with pytest.raises(wmt14.SgmError, match=r"document '2' is in source but not in reference"):
        wmt14.pair_documents(wmt14.parse_sgm(SRC), wmt14.parse_sgm(REF.split('<doc sysid="ref" docid="2">')[0]))


@pytest.mark.parametrize("broken, message", [
    (SRC.replace('<seg id="2">', '<seg id="1">'), "segment id 1 twice"),
    (SRC.replace("<doc docid='2' sysid=\"ref\">", '<doc sysid="ref">'), "has no docid"),
    (SRC.replace("</p>\n\n<p>", "</p>\nstray words\n<p>"), "text outside <seg>"),
    (SRC.replace("</doc>\n\n<doc", "\n<doc", 1), "'1012-bbc' is not closed"),
])
def test_malformed_files_are_errors(broken, message):
    with pytest.raises(wmt14.SgmError, match=message):
        wmt14.parse_sgm(broken)


def test_french_agreement_and_elision():
    assert french(["je", "aime", "la", "école"]) == ["j'aime", "l'école"]
    assert french(["le", "arbre", "près", "de", "le", "jardin"]) == ["l'arbre", "près", "du", "jardin"]
    assert french(["je", "ne", "aime", "pas", "à", "les", "hommes", "près", "de", "le", "hôtel"]) == \
        ["je", "n'aime", "pas", "aux", "hommes", "près", "de", "l'hôtel"]


def test_sample_corpus_is_deterministic_and_goes_through_sgm(tmp_path):
    assert generate_pairs(50, seed=3) == generate_pairs(50, seed=3) != generate_pairs(50, seed=4)
    written = write_sample(tmp_path, train=120, heldout=30, seed=3, doc_size=25)
    train, test = wmt14.read_pairs(written["train"]["en_fr"]), wmt14.read_pairs(written["test"]["en_fr"])
    assert train + test == generate_pairs(150, seed=3)
    assert not {s for s, _ in train} & {s for s, _ in test}
    assert (tmp_path / "train-fren-src.en.sgm").read_text().count("<doc ") == 5
