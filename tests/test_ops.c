#include "test_util.h"
int main(int argc, char **argv) { qt_init(argc, argv); return qt_finish(); }
