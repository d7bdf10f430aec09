"""SGLang plugin: bounded DSA replay metadata, one-launch MTP draft metadata, greedy-draft argmax exchange."""

__version__ = "0.1.0"
