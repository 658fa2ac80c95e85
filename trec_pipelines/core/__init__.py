"""The ground floor every part imports: streams, errors, state, checks, precision, the step
guard, the batch walker and copies, the input-dist groups, the subclass hooks.  It imports
no other folder of the package."""
