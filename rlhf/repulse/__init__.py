"""RePULSe (README.md, RePULSe section), beside PPO: its config, proposal role, step, evaluations, GCG attack and
plots, built on PPO's run through its hooks (`rlhf.cli.train_repulse`); PPO's modules do not import it."""
