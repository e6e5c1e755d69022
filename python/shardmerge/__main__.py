"""`python -m shardmerge ...`: the same CLI as the `shardmerge` command."""
from shardmerge import main

main()
