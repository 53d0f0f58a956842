"""enginectl's shell completion scripts (bash, zsh), their commands and options read from its
argument parser; engine names come from the running daemon (`enginectl completion names`)."""

from __future__ import annotations

import argparse

_BASH_COMPLETION = """\
# bash completion for enginectl: `source <(enginectl completion bash)` in ~/.bashrc, or save it
# as /etc/bash_completion.d/enginectl. Engine names come from the running daemon.
_enginectl() {
    local cur="${COMP_WORDS[COMP_CWORD]}" cmd="${COMP_WORDS[1]}" opts
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "COMMANDS --socket --version --help" -- "$cur"))
        return
    fi
    case "$cmd" in
OPTIONS
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
        return
    fi
    case "$cmd" in
        status|restart|stop|start|sleep|wake|logs)
            COMPREPLY=($(compgen -W "$(${ENGINECTL:-enginectl} completion names 2>/dev/null)" \\
                -- "$cur"));;
        generate) [ "${COMP_WORDS[COMP_CWORD-1]}" = "--engine" ] && COMPREPLY=($(compgen -W \\
                "$(${ENGINECTL:-enginectl} completion names 2>/dev/null)" -- "$cur"));;
        completion) COMPREPLY=($(compgen -W "bash zsh" -- "$cur"));;
    esac
}
complete -F _enginectl enginectl
"""

_ZSH_COMPLETION = """\
#compdef enginectl
# zsh completion for enginectl: save as _enginectl in a directory of $fpath (or
# `source <(enginectl completion zsh)` after compinit). Engine names come from the daemon.
_enginectl() {
    if (( CURRENT == 2 )); then
        compadd -- COMMANDS --socket --version --help
        return
    fi
    local -a opts
    case "${words[2]}" in
OPTIONS
    esac
    if [[ "${words[CURRENT]}" == -* ]]; then
        compadd -- ${opts[@]}
    elif [[ "${words[2]}" == (status|restart|stop|start|sleep|wake|logs) ]]; then
        compadd -- ${(f)"$(${ENGINECTL:-enginectl} completion names 2>/dev/null)"}
    elif [[ "${words[2]}" == completion ]]; then
        compadd -- bash zsh
    fi
}
_enginectl "$@"
"""


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for `shell`, its commands and options read from enginectl's
    parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = [name for name in sub.choices if name != "completion"] + ["completion"]
    options = {name: sorted(o for a in p._actions for o in a.option_strings)
               for name, p in sub.choices.items()}
    if shell == "bash":
        cases = "\n".join(f'        {name}) opts="{" ".join(opts)}";;'
                          for name, opts in options.items())
        template = _BASH_COMPLETION
    else:
        cases = "\n".join(f"        {name}) opts=({' '.join(opts)});;"
                          for name, opts in options.items())
        template = _ZSH_COMPLETION
    return template.replace("COMMANDS", " ".join(commands)).replace("OPTIONS", cases)
