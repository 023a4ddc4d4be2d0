"""Source analysis of model code, without running it: which chains of attributes a cell's
construct (and the helpers it calls) takes from `self` (source_chains; the steps a chain is
made of: chain_steps). Imports no other prefetchd role but the framework adapter;
prefetchd.hooks reads its results."""
