/* Shared by the C tests (tests/c/test_*.c, one program each).
 *
 *   CHECK(cond);                   counts a failure and prints where, and the condition
 *   CHECK(cond, "fmt", args...);   the same, plus a message
 *   return check_exit("test_x");   in main: reports, and gives main's exit status */
#ifndef MEMFIT_TESTS_CHECK_H
#define MEMFIT_TESTS_CHECK_H

#include <stdio.h>

static int failures = 0;

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      failures++;                                                          \
      fprintf(stderr, "FAIL %s:%d: (%s)", __FILE__, __LINE__, #cond);      \
      fprintf(stderr, " " __VA_ARGS__);                                    \
      fprintf(stderr, "\n");                                               \
    }                                                                      \
  } while (0)

static inline int check_exit(const char *name) {
  if (failures) {
    fprintf(stderr, "%s: %d failure(s)\n", name, failures);
    return 1;
  }
  printf("%s: ok\n", name);
  return 0;
}

#endif /* MEMFIT_TESTS_CHECK_H */
