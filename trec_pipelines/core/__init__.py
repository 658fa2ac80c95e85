"""The core every pipeline stands on: options, checks, the pipelined model, the step's start."""
