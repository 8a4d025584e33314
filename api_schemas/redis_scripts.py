"""Lua scripts, in one module: each is atomic on the Redis server and safe to repeat."""

# KEYS[1] = events stream, KEYS[2] = emitted hash; ARGV = maxlen, then (identity, kind, data) triples.
# An event whose identity is already in the hash is skipped, so a worker restarted from a
# checkpoint can re-emit the epochs it redoes without duplicating them. Identity "" = always add.
XADD_ONCE = """
local added = 0
for i = 2, #ARGV, 3 do
  local ident = ARGV[i]
  if ident == '' or redis.call('HSETNX', KEYS[2], ident, 1) == 1 then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'kind', ARGV[i + 1], 'data', ARGV[i + 2])
    added = added + 1
  end
end
return added
"""
