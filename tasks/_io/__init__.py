"""Shared plumbing of the stages, written once: atomic files and folders, hashing, HTTP, safe unzip, git.

One durability policy for everything the pipeline writes (see `files` and `folders`): new content is on
disk before a rename makes it visible, and the rename is flushed too, so a crash or a power cut leaves
the old content or the new one, never a mix. Nothing here imports Prefect, DVC or torch.
"""
