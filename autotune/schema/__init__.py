"""What goes in and what comes out, as pydantic models: the study spec and its workload field,
the tuned config, the named values they store, and the range of every number they hold."""
