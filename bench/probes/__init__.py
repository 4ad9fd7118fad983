"""One-off measurements that answered (or are answering) one design question each.

Not part of ``python -m bench``. ``bench/README.md`` lists each probe with its question and
the stored run that holds its answer; a probe whose question is closed and whose answer
is stored is deleted (its source stays in git history).
"""
