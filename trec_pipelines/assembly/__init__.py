"""The assembly every pipeline stands on: options, the pipelined model, the pipeline core, resume."""
