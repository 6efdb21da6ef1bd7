"""The pipeline engine: stages and their registry (`stage`, `registry`, `stagemap`), the step graph and
its cache keys (`graph`, `codeprint`), the content-addressed store (`store`), running steps and
their logs (`executor`, `steplog`), and why a step reran (`explain`)."""
