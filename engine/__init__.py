"""The engine-core child: EngineCoreProc and its models. Imports torch only lazily."""
