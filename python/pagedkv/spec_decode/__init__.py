"""Speculative decoding: draft proposers and the verification rule.

A proposer guesses the next few tokens of a sequence cheaply; the target
model scores them all in one forward pass and keeps the longest prefix its
own sampling agrees with. `ngram` proposes by prompt lookup (no draft model).
"""
