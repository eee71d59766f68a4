#!/usr/bin/env bash
# Long work on the device machine, past one call's 10-minute limit: `start` runs a command in its own
# process session (so it outlives the call), `wait` follows it from the next calls, each sent within the
# machine's 30 s idle time. Logs in /tmp/bg/NAME.log; `wait` copies the log and the exit status to $OUT.
# Usage: bash benchmarks/lab/background.sh start NAME COMMAND...
#        bash benchmarks/lab/background.sh wait NAME SECONDS [FILE...]   (returns early when NAME has
#          finished; copies each FILE that exists to $OUT too, so that what a run wrote so far comes back with
#          every wait: on 2026-11-29 an H200 came back bare between two waits sent back to back, /tmp and all)
#   COMMAND's words are joined into one shell line ("$*"), so a compound command goes as one quoted argument
#   (start q3 "cmd1 > log 2>&1; cmd2"); `start q3 bash -c 'cmd1; cmd2'` loses the inner quotes and runs nothing.
set -u
verb=$1 name=$2; shift 2
dir=/tmp/bg
mkdir -p "$dir"
case $verb in
  start)
    rm -f "$dir/$name.rc"
    setsid nohup bash -c "$*; echo \$? > $dir/$name.rc" > "$dir/$name.log" 2>&1 < /dev/null &
    echo "started $name (pid $!)" ;;
  wait)
    end=$(( $(date +%s) + $1 ))
    while [ ! -f "$dir/$name.rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    tail -c 6000 "$dir/$name.log"
    cp "$dir/$name.log" "${OUT:-/tmp}/$name.log" 2>/dev/null
    shift 1
    for f in "$@"; do [ ! -e "$f" ] || cp -r "$f" "${OUT:-/tmp}/" 2>/dev/null; done
    if [ -f "$dir/$name.rc" ]; then echo "finished $name: exit $(cat "$dir/$name.rc")"; exit "$(cat "$dir/$name.rc")"
    else echo "still running $name"; fi ;;
  *) echo "usage: background.sh start NAME COMMAND... | wait NAME SECONDS [FILE...]"; exit 2 ;;
esac
