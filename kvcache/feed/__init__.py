"""The feed side: one bucket's replica kept equal to its stream (`feed`, `consumer`, `sweeps`,
`statepoll`), how current it is known to be (`freshness`, with the quorum evidence of
`quorum`), the holds that keep reads from going back (`holds`), the near cache's side
(`cachekeeper`), and the changes it fans out (`changes`)."""
