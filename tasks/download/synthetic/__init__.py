"""The embedded source: a seeded generator of the PetFinder tutorial layout (CSVs + JPEGs), offline."""

from tasks.download.synthetic.generator import generate

__all__ = ["generate"]
