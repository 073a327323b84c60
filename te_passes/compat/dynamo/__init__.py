"""te_passes' Dynamo integration: compile-start callbacks and the Dynamo config scope of te_inductor compiles."""
