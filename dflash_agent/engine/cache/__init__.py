"""The state a request leaves behind: the target's KV cache, the drafter's context K/V, the prefix store that lends
both to later requests. Imports formats."""
