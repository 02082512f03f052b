"""The former name of :mod:`.groups`' ``process_group``, kept importable for modules that still import it here."""
from .groups import process_group

