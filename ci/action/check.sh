#!/usr/bin/env bash
# The check step of the GitHub Action (action.yml at the repository root): `shardcheck run` on the
# target, its JSON and HTML reports into the output folder, then the report as the job summary and
# as annotations on the source lines its failures name. Exits with run's status (0 pass, 1
# findings, 2 bad input, 3 timed out, 5 nothing checked), so the action's last step can fail the
# job after the reports are uploaded.
#
# Runs as well outside GitHub (that is how tests/test_github_action.py runs it): GITHUB_STEP_SUMMARY
# and GITHUB_OUTPUT are files it appends to when set. Inputs, from the environment (the action's
# step sets them; never interpolated into a script):
#   SHARDCHECK_ACTION_TARGET         NAME, NAME:VARIANT or module:callable (required)
#   SHARDCHECK_ACTION_SUITE          a named suite, or
#   SHARDCHECK_ACTION_SCENARIO_FILE  a scenario file (neither: run's default suite)
#   SHARDCHECK_ACTION_BACKEND        auto (default), gloo, nccl, gloo-cuda
#   SHARDCHECK_ACTION_SRC            the framework's checkout, passed as --target-src (empty: none)
#   SHARDCHECK_ACTION_OUTPUT         the reports' folder (default: shardcheck-reports)
#   SHARDCHECK_ACTION_EXTRA_ARGS     more options for run, as shell words (quotes kept, nothing expanded)
#   SHARDCHECK_ACTION_SHARDCHECK     the shardcheck executable (default: shardcheck, on PATH)
set -uo pipefail
shardcheck=${SHARDCHECK_ACTION_SHARDCHECK:-shardcheck}
target=${SHARDCHECK_ACTION_TARGET:-}
suite=${SHARDCHECK_ACTION_SUITE:-}
scenario_file=${SHARDCHECK_ACTION_SCENARIO_FILE:-}
src=${SHARDCHECK_ACTION_SRC:-}
out=${SHARDCHECK_ACTION_OUTPUT:-shardcheck-reports}
extra=${SHARDCHECK_ACTION_EXTRA_ARGS:-}

fail_early() {  # bad input before any run: said on stderr and in the summary, exit 2 as run's
  echo "shardcheck action: $1" >&2
  [ -z "${GITHUB_STEP_SUMMARY:-}" ] || printf '## shardcheck: not run\n\n%s\n' "$1" >>"$GITHUB_STEP_SUMMARY"
  [ -z "${GITHUB_OUTPUT:-}" ] || echo "verdict=error" >>"$GITHUB_OUTPUT"
  exit 2
}
[ -n "$target" ] || fail_early "the target input is required (NAME, NAME:VARIANT or module:callable)"
[ -z "$suite" ] || [ -z "$scenario_file" ] || fail_early "give suite or scenario-file, not both"

args=(run --target "$target" --backend "${SHARDCHECK_ACTION_BACKEND:-auto}")
if [ -n "$scenario_file" ]; then args+=(--scenario-file "$scenario_file"); fi
if [ -n "$suite" ]; then args+=(--suite "$suite"); fi
if [ -n "$src" ]; then args+=(--target-src "$src"); fi
if [ -n "$extra" ]; then
  # xargs splits as a shell would (quotes, backslashes) and expands nothing; one NUL after each word
  words=$(mktemp)
  if ! printf '%s\n' "$extra" | xargs printf '%s\0' >"$words"; then
    rm -f "$words"
    fail_early "extra-args does not split into words (an unmatched quote?): $extra"
  fi
  while IFS= read -r -d '' word; do args+=("$word"); done <"$words"
  rm -f "$words"
fi
mkdir -p "$out" || fail_early "cannot make the output folder '$out'"
json="$out/shardcheck.json"
html="$out/shardcheck.html"
"$shardcheck" "${args[@]}" --json-report "$json" --html-report "$html"
status=$?

case "$status" in
  0) verdict=pass ;; 1) verdict=fail ;; 3) verdict=timeout ;; 5) verdict=nothing-checked ;; *) verdict=error ;;
esac
if [ -s "$json" ]; then
  report=("$json" --annotations)  # the annotations' root: the report's checkout if inside this folder
  [ -z "${GITHUB_STEP_SUMMARY:-}" ] || report+=(--github-summary "$GITHUB_STEP_SUMMARY")
  "$shardcheck" report "${report[@]}" || echo "shardcheck action: the report could not be summarised" >&2
elif [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
  printf '## shardcheck: no report\n\n`shardcheck run` exited %s before writing one: its reason is in the step log.\n' \
    "$status" >>"$GITHUB_STEP_SUMMARY"
fi
if [ -n "${GITHUB_OUTPUT:-}" ]; then
  {
    echo "verdict=$verdict"
    [ ! -f "$json" ] || echo "report-json=$json"
    [ ! -f "$html" ] || echo "report-html=$html"
  } >>"$GITHUB_OUTPUT"
fi
exit "$status"
