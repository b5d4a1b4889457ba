"""The feed side: one bucket's replica kept equal to its stream (`feed`, `consumer`, `sweeps`,
`statepoll`), the quorum evidence that proves it current, and the changes it fans out."""
