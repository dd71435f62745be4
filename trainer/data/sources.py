"""The public data sets the presets read, each pinned to its source: the URLs `data fetch` downloads, the sha256 and
size of every file (checked before anything is built from it), the license and the citation.

Each set is built from its downloads into one folder of `data_sets()` (trainer/config/presets.py) by the converter
its `build` names (trainer/data/convert.py), in the layout the presets read. A set's folder is complete when every
file of `files` is there (a fetched set also has its SOURCE.json; a copy laid out by hand need not).

The hashes of cls-books-fr and eltec-fr were computed from the repositories' blobs at the pinned commits. The sites of
imdb and sst2 serve one archive each, unversioned: their sha256 is the one other dataset loaders publish for the same
URL (tensorflow-datasets and MLDatasets.jl for aclImdb_v1.tar.gz), so a changed archive is refused, not used.
allocine-fr's archive is a file of its repository at the pinned commit, and its sha256 is the one Hugging Face's
`datasets` publishes for the same file (its allocine loader's download checksums).
"""

from __future__ import annotations

import dataclasses

RAW = "https://raw.githubusercontent.com"


@dataclasses.dataclass(frozen=True)
class Remote:
    """One file to download: where from, its checksum and size, and the name it is saved under."""

    url: str
    sha256: str
    size: int  # bytes: the progress bar's total, and a download that grows past it is cut short
    name: str = ""  # the download's file name (default: the URL's last part)

    @property
    def filename(self) -> str:
        return self.name or self.url.rsplit("/", 1)[-1]


@dataclasses.dataclass(frozen=True)
class DataSet:
    """A public data set: what it is, where it comes from, and what its folder holds once built."""

    name: str  # the folder under data_sets(): what data paths start with (cls-books-fr/train.review.spm)
    title: str
    source: str  # the repository or page it comes from
    revision: str  # the commit, or the archive's version
    license: str
    citation: str
    remotes: tuple[Remote, ...]
    build: str  # the converter in trainer/data/convert.py
    files: tuple[str, ...]  # what the folder holds when complete

    @property
    def size(self) -> int:
        return sum(r.size for r in self.remotes)


_LAB = "moussaKam/transfer_learning_transformers"
_LAB_REV = "b14c34637f62e5c6ebf86401be0f6aba1099e8ba"
_LAB_FILES = {  # path in the lab's repository: (sha256, bytes)
    "cls-books/train.review.spm": ("a919c60894139d9ea30bd11fd3ea8869de03df493a486dd9b2be4f6e809ae232", 1495960),
    "cls-books/train.label": ("0ad0e86a0c4ca0d62af1f72d3a36afaa115c6904f77469cd70c1931fa8587775", 3200),
    "cls-books/valid.review.spm": ("4aa27090cc88994ecb65fec15419313405d69c9189c8eb02ef808235633c2693", 388465),
    "cls-books/valid.label": ("d80cdb6574ed4efbb00a124fc054c96d4b5e1ce55210b92fa0419350b7a92b3c", 800),
    "cls-books/test.review.spm": ("5d0322e84d5b433dd1072a81f7b62af4ee4adef400651b51b1efca9929fe2890", 1864544),
    "cls-books/test.label": ("28c78495388f7a1fac01120ef7ca73e0dd9a035ac91101ba7fe27fc155289933", 4000),
    "dict.txt": ("f587552218e9623edcaaa70d8762799f28b0f98f86b41657e21a9e02cfce4e8c", 577587),
    "sentencepiece.french.model": ("4cc472d2d984575d2d1774cfc0150ff9acad6f4430f2f34901d3a30062cd164b", 1115362),
}

CLS_BOOKS = DataSet(
    name="cls-books-fr",
    title="CLS (Webis-CLS-10) French book reviews, as the transfer-learning lab distributes them",
    source=f"https://github.com/{_LAB}",
    revision=_LAB_REV,
    license="none stated in the lab's repository; the reviews are Amazon's, from Webis-CLS-10 (Zenodo record "
            "3251672), distributed for research: read its terms before any other use",
    citation="Prettenhofer, P. and Stein, B. (2010). Cross-Language Text Classification using Structural "
             "Correspondence Learning. ACL 2010. Data: Webis-CLS-10, doi:10.5281/zenodo.3251672",
    remotes=tuple(Remote(f"{RAW}/{_LAB}/{_LAB_REV}/{path}", sha, size) for path, (sha, size) in _LAB_FILES.items()),
    build="cls_books",
    files=("train.review.spm", "train.label", "valid.review.spm", "valid.label", "test.review.spm", "test.label",
           "dict.txt", "sentencepiece.french.model", "train.review.txt", "valid.review.txt", "test.review.txt"),
)

_ELTEC = "COST-ELTeC/ELTeC-fra"
_ELTEC_REV = "83f0a43fdb967cd1db646027a1a237307e4924a1"

ELTEC = DataSet(
    name="eltec-fr",
    title="ELTeC-fra: 100 French novels 1840-1920 (level-1 TEI), one paragraph a line",
    source=f"https://github.com/{_ELTEC}",
    revision=_ELTEC_REV,
    license="public domain (the texts); no rights claimed on the encoding (the corpus' README)",
    citation="Schöch, C. and Burnard, L. (eds.) (2021). French Novel Corpus (ELTeC-fra), v1.0.1. European Literary "
             "Text Collection (ELTeC), COST Action CA16204. doi:10.5281/zenodo.4662433",
    remotes=(),  # filled below from trainer/data/eltec_files.py (100 novels and the metadata table)
    build="eltec",
    files=("eltec_fra.txt.gz", "metadata.tsv"),
)

IMDB = DataSet(
    name="imdb",
    title="Large Movie Review Dataset v1.0 (IMDB): 25,000 train, 25,000 test, 50,000 unlabelled reviews",
    source="https://ai.stanford.edu/~amaas/data/sentiment/",
    revision="v1.0 (aclImdb_v1.tar.gz)",
    license="none stated; distributed by its authors for research, who ask that the paper below be cited",
    citation="Maas, A. L., Daly, R. E., Pham, P. T., Huang, D., Ng, A. Y. and Potts, C. (2011). Learning Word "
             "Vectors for Sentiment Analysis. ACL 2011",
    remotes=(Remote("https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
                    "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe", 84125825),),
    build="imdb",
    files=("train.jsonl.gz", "test.jsonl.gz", "unsup.txt.gz"),
)

SST2 = DataSet(
    name="sst2",
    title="Stanford Sentiment Treebank, binary sentences (SST-2): train 6,920, dev 872, test 1,821",
    source="https://nlp.stanford.edu/sentiment/",
    revision="trainDevTestTrees_PTB.zip (the treebank's release)",
    license="none stated; released by its authors with the paper below, which they ask be cited",
    citation="Socher, R., Perelygin, A., Wu, J., Chuang, J., Manning, C. D., Ng, A. and Potts, C. (2013). Recursive "
             "Deep Models for Semantic Compositionality Over a Sentiment Treebank. EMNLP 2013",
    remotes=(Remote("https://nlp.stanford.edu/sentiment/trainDevTestTrees_PTB.zip",
                    "5c613a4f673fc74097d523a2c83f38e0cc462984d847b82c7aaf36b01cbbbfcc", 789539),),
    build="sst2",
    files=("train.tsv", "dev.tsv", "test.tsv"),
)

_ALLOCINE = "TheophileBlard/french-sentiment-analysis-with-bert"
_ALLOCINE_REV = "719f09fb11024061728458511570d9e5e73162dd"  # the archive last changed in 0a3a847 (2020-02-07)

ALLOCINE = DataSet(
    name="allocine-fr",
    title="Allociné French film reviews: train 160,000, valid 20,000, test 20,000 (each split its own films, "
          "balanced classes)",
    source=f"https://github.com/{_ALLOCINE}",
    revision=_ALLOCINE_REV,
    license="MIT (the repository's LICENSE: Copyright (c) 2020 Théophile Blard); the reviews were written by "
            "allocine.fr's users",
    citation="Blard, T. (2020). French sentiment analysis with BERT. GitHub repository, "
             f"https://github.com/{_ALLOCINE}",
    remotes=(Remote(f"{RAW}/{_ALLOCINE}/{_ALLOCINE_REV}/allocine_dataset/data.tar.bz2",
                    "8c49a8cac783da201697ed1a91b36d2f6618222b3b7ea1c2996f2a3fbc37dfb4", 66625305),),
    build="allocine",
    files=("train.jsonl.gz", "valid.jsonl", "test.jsonl"),
)


def _with_eltec_files(base: DataSet) -> DataSet:
    from trainer.data.eltec_files import METADATA, NOVELS

    remotes = [Remote(f"{RAW}/{_ELTEC}/{_ELTEC_REV}/level1/{name}", sha, size) for name, sha, size in NOVELS]
    remotes.append(Remote(f"{RAW}/{_ELTEC}/{_ELTEC_REV}/ELTeC-fra_metadata.tsv", *METADATA))
    return dataclasses.replace(base, remotes=tuple(remotes))


SETS: dict[str, DataSet] = {s.name: s for s in (CLS_BOOKS, _with_eltec_files(ELTEC), IMDB, SST2, ALLOCINE)}
