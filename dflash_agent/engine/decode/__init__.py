"""One request's tokens: speculative decoding (drafts, verification, the draft policy), sampling, grammars.
Imports load and the rooms below it."""
