# Shared step runner for the benchmark pipelines (sourced, not run). The caller sets OUT (log folder) and TIMINGS.
#
#   run_step NAME OUTPUT COMMAND...   run COMMAND, logging to $OUT/NAME.log, unless OUTPUT exists (or ALWAYS=1);
#                                     fails the pipeline (printing the log's tail) if COMMAND fails or writes no OUTPUT;
#                                     appends "NAME<TAB>seconds" to $TIMINGS.
#   show_and_run COMMAND...           print COMMAND (into the step's log), then run it
#   optional FLAG VALUE               print "FLAG VALUE" as two lines when VALUE is non-empty (for mapfile)

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

run_step() {
    local name="$1" output="$2"
    shift 2
    if [[ -e "$output" && "${ALWAYS:-0}" != 1 ]]; then
        log "$name: skipped ($output exists)"
        return 0
    fi
    local logfile="$OUT/$name.log" start=$SECONDS
    log "$name: running (log: $logfile)"
    { printf '$'; printf ' %q' "$@"; printf '\n'; } >"$logfile"
    if ! "$@" >>"$logfile" 2>&1 </dev/null; then
        log "$name: FAILED after $((SECONDS - start)) s; last lines of $logfile:"
        tail -n 25 "$logfile" >&2
        exit 1
    fi
    if [[ ! -e "$output" ]]; then
        log "$name: finished but did not write $output; see $logfile"
        exit 1
    fi
    local elapsed=$((SECONDS - start))
    printf '%s\t%s\n' "$name" "$elapsed" >>"$TIMINGS"
    log "$name: done in ${elapsed} s"
}

optional() {
    if [[ -n "$2" ]]; then printf '%s\n%s\n' "$1" "$2"; fi
}

show_and_run() {
    { printf '+'; printf ' %q' "$@"; printf '\n'; }
    "$@"
}
