"""Inversion of rows that are a known function of each position's state (a KV cache, a public projection, states
under noise or quantisation, positions missing, one vector): :mod:`.attack` chooses the route, :mod:`.search` searches
in the rows' space, :mod:`.route` gives :func:`lminvert.invert` its results."""
