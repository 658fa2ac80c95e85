"""What a run is set up with: the command line and its presets (:mod:`.config`), the model's
shapes (:mod:`.model`), the compiled variants (:mod:`.variants`) and the shaped link the ranks
talk over (:mod:`.netns`).  The bottom of the benchmark: it imports no other part of it.
"""
